import os
import sys

# Import the package from this checkout (python/), whatever the working directory.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
