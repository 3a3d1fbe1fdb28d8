import os
import sys

# Import the package from this checkout (python/), whatever the working directory; with
# FERRY_TEST_INSTALLED=1 (make test's venv) the installed package instead, and check that it is.
if os.environ.get("FERRY_TEST_INSTALLED") == "1":
    import ferry

    _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.abspath(ferry.__file__).startswith(_here + os.sep):
        raise RuntimeError("FERRY_TEST_INSTALLED=1 but ferry comes from the checkout (%s), not "
                           "the install" % ferry.__file__)
else:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
