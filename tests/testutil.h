/*
 * Helpers shared by the cmocka tests: child processes, temporary names, waiting for files.
 * Multi-process tests fork helper processes (libuv-style) and talk to them through ferry itself
 * or through pipes.
 */
#ifndef FERRY_TESTUTIL_H
#define FERRY_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <sys/types.h>

#include <cmocka.h>

#include "ferry.h"

/* Asserts a ferry call succeeded, printing the status and detail otherwise. */
#define FR_OK(call)                                                                                \
  do {                                                                                             \
    int fr_ok_rc_ = (call);                                                                        \
    if (fr_ok_rc_ != 0)                                                                            \
      fail_msg("%s -> %s (%s): %s", #call, ferry_status_name(fr_ok_rc_),                           \
               ferry_strerror(fr_ok_rc_), ferry_last_error());                                     \
  } while (0)

/* fork() for the tests' child processes: the child is SIGKILLed when the thread that forked it
 * ends (PR_SET_PDEATHSIG, kept across exec), and one whose parent had already gone before that
 * was set exits at once. A case that fails an assertion half-way leaves its function without
 * stopping its children (cmocka jumps out); they then die with the test process instead of
 * holding ctest's output pipe (or a pipe the test would close) open until ctest's timeout. Call
 * it from the thread that runs the case (or one that outlives the child). Flushes stdio first. */
pid_t tu_fork(void);
/* Forks a child (tu_fork) that runs fn(arg) and _exit()s with its return value. */
pid_t tu_spawn(int (*fn)(void *arg), void *arg);
/* Starts this test binary again as a helper process (tu_fork + exec, so it is safe from a
 * multi-threaded parent): argv[0] is replaced by /proc/self/exe; the list ends with NULL. */
pid_t tu_spawn_exec(const char *arg1, ...);
/* Waits for a child; returns its exit status, or 128+signal if it was killed. */
int tu_wait(pid_t pid);
/* Wake-ups so far of process pid's threads (all of them, or those named `thread`, e.g.
 * "ferry-progress"): their voluntary context switches, each a thread that slept and was woken,
 * as `ferry bench` counts them; preemptions, which a loaded machine adds to a sleeping process
 * too, are left out. -1 when /proc cannot tell. */
long tu_wakeups(pid_t pid, const char *thread);
/* The allowance a test gives a call over its own timeout when it checks that the call returned
 * in time (elapsed <= timeout_ms + allowance): `plain_ms` in a plain build; in a sanitizer build
 * (ASan, UBSan, TSan: code 2-15x slower, and make test runs those stages on 2 cores beside other
 * tests and builds) at least the call's own timeout. A call that ignores its timeout waits for
 * what is not coming (a stopped or dead peer: seconds) and still fails the check. */
double tu_allowance_ms(int timeout_ms, double plain_ms);
/* A pipe pair for parent/child hand-offs of small strings. */
typedef struct tu_pipe {
  int rd, wr;
} tu_pipe;
void tu_pipe_open(tu_pipe *p);
void tu_pipe_close(tu_pipe *p);
void tu_pipe_put(tu_pipe *p, const void *buf, size_t len);
/* Reads exactly len bytes; returns 0, or -1 on EOF/timeout. */
int tu_pipe_get(tu_pipe *p, void *buf, size_t len, int timeout_ms);
/* Removes a directory and the files directly in it (tests' temporary directories). */
void tu_rmdir_files(const char *dir);
/* Fills buf with a deterministic pattern derived from seed. */
void tu_fill(void *buf, size_t len, uint64_t seed);

/* A name service that does not answer: from tu_dns_hang() on, every name ferry resolves
 * (fr_resolve) waits in the lookup until tu_dns_answer(), which lets the waiting lookups go
 * (failing them, EAI_NONAME) and waits for them to finish, so that no thread of theirs outlives
 * the test. Numeric addresses never reach the lookup. Returns how many lookups were held. */
void tu_dns_hang(void);
int tu_dns_answer(void);

/* Applies the environment's choice of cases to the cmocka run that follows: FERRY_TEST_ONLY runs
 * only the cases whose names match its glob (`*` and `?`; e.g. test_owner_stopped, used by
 * tests/faults/run.sh), FERRY_TEST_SKIP leaves out those matching its glob. Every test's main
 * calls it before cmocka_run_group_tests. */
void tu_filter(void);

/* Why a part of a test cannot run here. */
typedef enum tu_skip_why {
  /* Something the project installs is missing (a Debian package in scripts/deps.sh test) or
   * would be there for root: a user fixes it. Under `make test` (FERRY_TEST_STRICT=1) this
   * fails the test, so a missing install step never passes as a skip. */
  TU_SKIP_FIXABLE,
  /* Nothing to install fixes it: no GPU, a transport this run leaves out, not root. */
  TU_SKIP_NOT_HERE,
} tu_skip_why;
/* Why test hosts in network namespaces could not be made: TU_SKIP_FIXABLE for root on a full
 * system (iproute2 missing, or a real fault), TU_SKIP_NOT_HERE when not root or in a chroot whose
 * root is not a mount point (`ip -n` remounts / as a slave there and fails). */
tu_skip_why tu_netns_skip_why(void);
/* Reports "SKIP <fmt...>" on stderr; for TU_SKIP_FIXABLE under FERRY_TEST_STRICT=1 it fails the
 * running test instead (does not return). The caller returns after it. */
void tu_skip(tu_skip_why why, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* CUDA tests (their file holds the line "// ferry-test: cuda": ctest label cuda) run against the
 * in-tree stand-in driver (tests/cudastub; ctest passes its path in FERRY_CUDASTUB), or against
 * the real driver when FERRY_TEST_CUDA=driver (scripts/gpu-check.sh). Call before any other ferry
 * call: sets FERRY_CUDA_LIB for this process and the processes it starts, and loads the driver.
 * True when one is loaded; else it reported the skip ("no CUDA driver: ..."; a missing stand-in
 * is fixable, a machine without a GPU is not) and the caller returns. */
bool tu_cuda_use(void);

/* A slow-loris against 127.0.0.1:port: n connections each send a request line, then a header
 * line every interval_ms and never the blank line that ends the head; for run_ms each one the
 * server closes is replaced (at most 4n made in all), and every 200 ms `probe` (a GET request,
 * ending with its blank line) is sent on a fresh connection. Then the open ones go on trickling,
 * unreplaced, until the server has closed them all or settle_ms has passed. Bounded in count and
 * time; stops by itself. */
typedef struct tu_loris {
  int opened;         /* trickling connections made */
  int probes;         /* probes sent */
  int probes_ok;      /* answered 200 within probe_ms */
  int worst_probe_ms; /* the slowest answer (or probe_ms for none) */
  int still_open;     /* trickling connections the server had not closed after settle_ms */
} tu_loris;
tu_loris tu_slowloris(int port, int n, int interval_ms, int run_ms, int settle_ms,
                      const char *probe, int probe_ms);

#endif
