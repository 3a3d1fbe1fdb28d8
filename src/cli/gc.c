/*
 * `ferry gc`: removes what killed ferry processes left in FERRY_CTL_DIR (/dev/shm by default):
 * control cells of dead engines and half-made ones (ferry_ctl_gc), and the Python binding's refit
 * rendezvous files (`ferry-refit-NAME`: the sender's address, then its pid) of dead senders,
 * with their temporaries (`ferry-refit-NAME.RAND.PID.tmp`). Files of live processes stay, and so
 * does anything that is not a regular file of this user's (said on stderr): another user may have
 * planted it.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "core/core.h"
#include "ferry.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char gc_usage[] =
    "usage: ferry gc [--dry-run] [--json]\n\n"
    "Removes what killed ferry processes left in FERRY_CTL_DIR (default /dev/shm): control\n"
    "cells whose engine is dead (ferry-ctl-NAME) and half-made ones, and refit rendezvous\n"
    "files of dead senders (ferry-refit-NAME). Files of live processes are never touched.\n"
    "Prints each file removed and why.\n\n"
    "  --dry-run  only say what would be removed\n"
    "  --json     one object per file: {\"path\", \"why\", \"removed\"}\n";

typedef struct gc_out {
  bool json, dry_run;
  int count;
} gc_out;

static void report(const char *path, const char *why, void *arg) {
  gc_out *o = arg;
  o->count++;
  if (o->json) {
    fputs("{\"path\":", stdout);
    cli_json_string(stdout, path);
    fputs(",\"why\":", stdout);
    cli_json_string(stdout, why);
    printf(",\"removed\":%s}\n", o->dry_run ? "false" : "true");
  } else {
    printf("%s %s: %s\n", o->dry_run ? "would remove" : "removed", path, why);
  }
}

static bool pid_gone(long pid) { return pid > 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH; }

/* The pid a refit rendezvous file names (its second line), or a temporary's (NAME.RAND.PID.tmp);
 * 0 when there is none. Another user may plant anything under these names in a shared directory:
 * only a regular file of this user's is read (fr_open_shared never follows a link nor blocks on
 * a FIFO), and anything else is skipped, saying why on stderr. */
static long rendezvous_pid(int dfd, const char *dir, const char *file) {
  int fd;
  if (fr_open_shared(dfd, file, O_RDONLY, &fd) != 0) {
    fprintf(stderr, "ferry gc: skipped %s/%s: %s\n", dir, file, ferry_last_error());
    return 0;
  }
  size_t n = strlen(file);
  long pid = 0;
  if (n > 4 && strcmp(file + n - 4, ".tmp") == 0) {
    const char *dot = file + n - 5;
    while (dot > file && *dot != '.')
      dot--;
    pid = *dot == '.' ? strtol(dot + 1, NULL, 10) : 0;
  } else {
    char text[512] = "";
    ssize_t got = read(fd, text, sizeof text - 1);
    text[got > 0 ? got : 0] = '\0';
    const char *nl = strchr(text, '\n');
    pid = nl ? strtol(nl + 1, NULL, 10) : 0;
  }
  close(fd);
  return pid;
}

static int gc_rendezvous(gc_out *o) {
  const char *dir = ferry_config_get("FERRY_CTL_DIR");
  if (!*dir)
    dir = "/dev/shm";
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = dfd >= 0 ? fdopendir(dup(dfd)) : NULL;
  if (!d) {
    if (dfd >= 0)
      close(dfd);
    return 0; /* ferry_ctl_gc already said why */
  }
  for (struct dirent *e; (e = readdir(d));) {
    if (strncmp(e->d_name, "ferry-refit-", 12) != 0)
      continue;
    long pid = rendezvous_pid(dfd, dir, e->d_name);
    if (!pid_gone(pid))
      continue;
    char path[4096], why[96];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    snprintf(why, sizeof why, "refit rendezvous of dead sender pid %ld", pid);
    if (!o->dry_run && unlinkat(dfd, e->d_name, 0) != 0) {
      fprintf(stderr, "ferry gc: cannot remove %s: %s\n", path, strerror(errno));
      continue;
    }
    report(path, why, o);
  }
  closedir(d);
  close(dfd);
  return 0;
}

int cli_gc(int argc, char **argv) {
  gc_out o = {0};
  const cli_opt opts[] = {
      {"dry-run", CLI_ARG_FLAG, &o.dry_run, 0, 0}, {"json", CLI_ARG_FLAG, &o.json, 0, 0}, {0}};
  const cli_cmd cmd = {"gc", gc_usage, NULL, 0, 0, opts};
  char **operands;
  if (cli_parse(&cmd, argc, argv, &operands) < 0)
    return CLI_USAGE;
  int rc = ferry_ctl_gc(o.dry_run, report, &o);
  if (rc < 0)
    return cli_fail("gc", rc, "control cells");
  gc_rendezvous(&o);
  if (!o.json && o.count == 0)
    printf("nothing to remove\n");
  return CLI_OK;
}
