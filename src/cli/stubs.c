/*
 * Subcommands whose implementation has not landed yet. Each says so clearly instead of pretending.
 * Remove an entry here when its real implementation lands.
 */
#include "cli/cli.h"

#include <stdio.h>

