/*
 * Control cells: the weight lifecycle agreed by controllers and ranks through shared memory.
 * Ranks run as forked processes (and, in the stress and refit tests, threads); controllers as
 * the test process or forked children. Covers transitions, concurrent controllers, dead and
 * stopped (SIGSTOP) ranks, a controller killed mid-request, stale cells, the refit commit hook,
 * and the lost-update bug of the one-int32 design (ranks cannot write the command word; a lagging
 * rank gets the latest command). No assertion depends on timing.
 */
// ferry-test: threaded
#include "testutil.h"

#include "control/cell.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STRESS_CYCLES_DEFAULT 1500
#else
#define STRESS_CYCLES_DEFAULT 10000 /* the 100000: FERRY_CTL_STRESS_CYCLES=100000 */
#endif
#define MAXR 16

/* State shared by the test process and its children (an anonymous shared mapping). */
typedef struct shared {
  _Atomic uint64_t stop;           /* the seq of the abort that stops the ranks (0: not stopping) */
  _Atomic uint64_t handled[MAXR];  /* commands each rank handled */
  _Atomic uint64_t last_seq[MAXR]; /* the last seq each rank handled */
  _Atomic uint64_t gaps;           /* a rank saw a seq other than last + 1 (a lost command) */
  _Atomic uint64_t cycles;         /* stress: completed clear+update cycles */
  _Atomic uint64_t timeouts, errors, busy;
} shared;

static shared *sh;
static char dir[64];
static char name[64];
static int name_counter;

static void new_name(void) { snprintf(name, sizeof name, "t%d-%d", (int)getpid(), ++name_counter); }

static int setup(void **state) {
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(sh != MAP_FAILED);
  memset(sh, 0, sizeof *sh);
  new_name();
  return 0;
}

static int teardown(void **state) {
  munmap(sh, sizeof *sh);
  return 0;
}

static int group_setup(void **state) {
  snprintf(dir, sizeof dir, "/dev/shm/ferry-ctltest-XXXXXX");
  assert_non_null(mkdtemp(dir));
  setenv("FERRY_CTL_DIR", dir, 1);
  setenv("FERRY_CTL_CHECK_MS", "20", 1);
  setenv("FERRY_LOG", "error", 1);
  ferry_log_set_level(FERRY_LOG_ERROR);
  return 0;
}

static int group_teardown(void **state) {
  tu_rmdir_files(dir);
  return 0;
}

/* ---- a rank in a child process or thread ---- */

typedef struct rank_cfg {
  uint32_t rank;
  int fail_update;    /* status the update handler fails with (0: succeed) */
  ferry_ctl_cmd hold; /* this command's handler tells `note` and waits for a byte on `gate` */
  int gate_rd, note_wr;
  bool random_delay;
} rank_cfg;

static void random_pause(unsigned *seed) {
  unsigned r = rand_r(seed) % 64;
  if (r < 8)
    sched_yield();
  else if (r == 8) {
    struct timespec ts = {0, (long)(rand_r(seed) % 50) * 1000};
    nanosleep(&ts, NULL);
  }
}

typedef struct handler_arg {
  rank_cfg *cfg;
  unsigned seed;
} handler_arg;

static int maybe_hold(rank_cfg *c, ferry_ctl_cmd cmd) {
  if (c->hold != cmd)
    return 0;
  char b = 'h';
  if (write(c->note_wr, &b, 1) != 1 || read(c->gate_rd, &b, 1) != 1)
    return FERRY_ESYS;
  return 0;
}

static int on_clear(void *p) {
  handler_arg *a = p;
  if (a->cfg->random_delay)
    random_pause(&a->seed);
  return maybe_hold(a->cfg, FERRY_CTL_CLEAR);
}

static int on_update(void *p) {
  handler_arg *a = p;
  if (a->cfg->random_delay)
    random_pause(&a->seed);
  int rc = maybe_hold(a->cfg, FERRY_CTL_UPDATE);
  if (rc == 0 && a->cfg->fail_update)
    rc = a->cfg->fail_update; /* message: the last error detail, set below */
  return rc;
}

static void record(uint32_t rank, uint64_t seq) {
  uint64_t last = atomic_exchange(&sh->last_seq[rank], seq);
  if (seq != last + 1)
    atomic_fetch_add(&sh->gaps, 1);
  atomic_fetch_add(&sh->handled[rank], 1);
}

static int rank_loop(rank_cfg *cfg) {
  pid_t parent = getppid(); /* the test process (for a thread: its process's parent) */
  ferry_ctl_rank *r = NULL;
  int rc = ferry_ctl_rank_open(name, cfg->rank, NULL, &r);
  if (rc) {
    fprintf(stderr, "rank %u open: %s\n", cfg->rank, ferry_last_error());
    return 10;
  }
  handler_arg a = {cfg, cfg->rank * 7919u + 1};
  ferry_ctl_handlers h = {sizeof h, on_clear, on_update, NULL, &a};
  /* Until the stopping abort (stop_ranks), which always gets its ack. The abort's seq, not the
   * stop flag alone, decides: a rank that acked an earlier abort must not see `stop` set right
   * after its controller returned and leave before the stopping abort is issued. */
  for (;;) {
    ferry_ctl_command cmd;
    rc = ferry_ctl_rank_step(r, &h, 1000, &cmd);
    if (rc == FERRY_ETIMEDOUT) {
      if (getppid() != parent) { /* the test process is gone (a failed test left us behind) */
        rc = 0;
        break;
      }
      continue;
    }
    if (rc) {
      fprintf(stderr, "rank %u step: %s\n", cfg->rank, ferry_last_error());
      break;
    }
    uint64_t stop = atomic_load(&sh->stop);
    if (cmd.cmd != FERRY_CTL_ABORT)
      record(cfg->rank, cmd.seq);
    else if (stop != 0 && cmd.seq >= stop)
      break;
  }
  ferry_ctl_rank_close(r);
  return rc ? 11 : 0;
}

static int rank_child(void *p) { return rank_loop(p); }

static void *rank_thread(void *p) { return (void *)(intptr_t)rank_loop(p); }

typedef struct ranks {
  int n;
  pid_t pid[MAXR];
  rank_cfg cfg[MAXR];
} ranks;

/* Waits (yielding) until ranks 0..n-1 are attached and alive. */
static void wait_attached(ferry_ctl *c, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) {
    ferry_ctl_rank_status st = {.size = sizeof st};
    FR_OK(ferry_ctl_rank_status_get(c, i, &st));
    while (!st.alive) {
      sched_yield();
      FR_OK(ferry_ctl_rank_status_get(c, i, &st));
    }
  }
}

/* Forks n rank processes and waits until every rank is attached. */
static void start_ranks(ranks *rs, int n, const rank_cfg *tmpl) {
  rs->n = n;
  for (int i = 0; i < n; i++) {
    rs->cfg[i] = tmpl ? tmpl[i] : (rank_cfg){.gate_rd = -1, .note_wr = -1};
    rs->cfg[i].rank = (uint32_t)i;
    rs->pid[i] = tu_spawn(rank_child, &rs->cfg[i]);
  }
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  wait_attached(c, (uint32_t)n);
  ferry_ctl_close(c);
}

/* Stops the ranks: the seq the stopping abort will get, then the abort (nobody else issues
 * commands by now); expects every rank to ack it and exit cleanly. */
static void stop_ranks(ranks *rs) {
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  ferry_ctl_status st = {.size = sizeof st};
  FR_OK(ferry_ctl_status_get(c, &st));
  atomic_store(&sh->stop, st.seq + 1);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_ABORT, 20000));
  ferry_ctl_close(c);
  for (int i = 0; i < rs->n; i++)
    assert_int_equal(tu_wait(rs->pid[i]), 0);
}

static ferry_ctl_status get_status(ferry_ctl *c) {
  ferry_ctl_status st = {.size = sizeof st};
  FR_OK(ferry_ctl_status_get(c, &st));
  return st;
}

/* ---- tests ---- */

static void test_names_and_args(void **state) {
  ferry_ctl_cell *cell = NULL;
  assert_int_equal(ferry_ctl_cell_create("bad/name", 2, NULL, &cell), FERRY_EINVAL);
  assert_int_equal(ferry_ctl_cell_create(".hidden", 2, NULL, &cell), FERRY_EINVAL);
  assert_int_equal(ferry_ctl_cell_create(name, 0, NULL, &cell), FERRY_EINVAL);
  assert_int_equal(ferry_ctl_cell_create(name, FERRY_CTL_MAX_RANKS + 1, NULL, &cell), FERRY_EINVAL);
  assert_null(cell);
  ferry_ctl *c = NULL;
  assert_int_equal(ferry_ctl_open(name, &c), FERRY_ENOTFOUND);
  assert_non_null(strstr(ferry_last_error(), name));
  ferry_ctl_cmd cmd;
  FR_OK(ferry_ctl_cmd_parse("update", &cmd));
  assert_int_equal(cmd, FERRY_CTL_UPDATE);
  assert_int_equal(ferry_ctl_cmd_parse("reboot", &cmd), FERRY_EINVAL);
  assert_string_equal(ferry_ctl_state_name(FERRY_CTL_CLEARED), "cleared");
  ferry_ctl_close(NULL);
  ferry_ctl_cell_close(NULL);
  ferry_ctl_rank_close(NULL);
}

/* Liveness is by pid and start time (field 22 of /proc/PID/stat): a process's own start time
 * is read, and the same pid with another start time (a reused pid) is dead. */
static void test_pid_start_time(void **state) {
  (void)state;
  FILE *f = fopen("/proc/self/stat", "r");
  assert_non_null(f);
  char line[1024] = "";
  assert_non_null(fgets(line, sizeof line, f));
  fclose(f);
  const char *p = strrchr(line, ')');
  unsigned long long want = 0;
  for (int field = 3; field <= 22 && p; field++)
    p = strchr(p + 1, ' ');
  assert_non_null(p);
  want = strtoull(p + 1, NULL, 10);
  assert_true(want != 0);
  assert_int_equal(fr_ctl_pid_start(getpid()), want);
  assert_true(fr_ctl_pid_alive(getpid(), want));
  assert_false(fr_ctl_pid_alive(getpid(), want + 1));
  assert_true(fr_ctl_owner_alive(fr_ctl_owner(getpid(), want)));
  assert_false(fr_ctl_owner_alive(fr_ctl_owner(getpid(), want + 1)));
}

static void test_layout_and_mode(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 3, NULL, &cell));
  assert_int_equal(ferry_ctl_cell_incarnation(cell), 1);
  char path[256];
  snprintf(path, sizeof path, "%s/ferry-ctl-%s", dir, name);
  struct stat st;
  assert_int_equal(stat(path, &st), 0);
  assert_int_equal(st.st_mode & 0777, 0600);
  assert_int_equal(st.st_size, FR_CTL_HEADER_BYTES + FR_CTL_PAGE);
  FILE *f = fopen(path, "rb");
  fr_ctl_header hdr;
  assert_int_equal(fread(&hdr, sizeof hdr, 1, f), 1);
  fclose(f);
  assert_true(hdr.magic == FR_CTL_MAGIC);
  assert_int_equal(hdr.layout_version, FR_CTL_LAYOUT_VERSION);
  assert_int_equal(hdr.nranks, 3);
  assert_int_equal(hdr.engine_pid, getpid());
  /* a live engine keeps its name */
  ferry_ctl_cell *again = NULL;
  assert_int_equal(ferry_ctl_cell_create(name, 3, NULL, &again), FERRY_EEXIST);
  assert_non_null(strstr(ferry_last_error(), "live engine"));
  ferry_ctl_cell_close(cell);
  assert_int_equal(stat(path, &st), -1);
}

/* A process of the user writes the cell the way a hostile rank or a stray writer would: a failure
 * record whose error is no ferry status, a state byte outside the enum, and a header whose
 * layout words point past the file. The controller that has the cell open goes on with the
 * layout it checked when it opened it and reports a ferry status; a new open refuses the
 * header with FERRY_EPROTO. (The old controller returned the rank's raw word, INT_MIN here, as
 * its status.) */
static void test_hostile_cell(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  ferry_ctl_rank *r0 = NULL, *r1 = NULL;
  FR_OK(ferry_ctl_rank_open(name, 0, NULL, &r0));
  FR_OK(ferry_ctl_rank_open(name, 1, NULL, &r1));
  char path[256];
  snprintf(path, sizeof path, "%s/ferry-ctl-%s", dir, name);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  assert_true(fd >= 0);
  uint8_t *file =
      mmap(NULL, FR_CTL_HEADER_BYTES + FR_CTL_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  assert_true(file != MAP_FAILED);
  fr_ctl_header *hdr = (fr_ctl_header *)file;
  fr_ctl_line *line1 = (fr_ctl_line *)(file + FR_CTL_HEADER_BYTES + FR_CTL_LINE);

  /* the lines say how the next command (seq 1) ended before it is issued: rank 0 cleared,
   * rank 1 failed it with INT_MIN and a message with no NUL */
  fr_ctl_line *line0 = (fr_ctl_line *)(file + FR_CTL_HEADER_BYTES);
  memset((void *)line1->message, 'x', sizeof line1->message);
  atomic_store(&line1->error, INT32_MIN);
  atomic_store(&line1->fail_seq, 1);
  atomic_store(&line1->ack, fr_ctl_word(1, FERRY_CTL_FAILED));
  atomic_store(&line0->ack, fr_ctl_word(1, FERRY_CTL_CLEARED));
  int rc = ferry_ctl_request(c, FERRY_CTL_CLEAR, 5000);
  assert_int_equal(rc, FERRY_EPEER);
  assert_non_null(strstr(ferry_last_error(), "rank 1 failed"));
  ferry_ctl_rank_status rs = {.size = sizeof rs};
  FR_OK(ferry_ctl_rank_status_get(c, 1, &rs));
  assert_int_equal(rs.error, FERRY_EPEER);
  assert_int_equal(strlen(rs.message), FERRY_CTL_MESSAGE_MAX - 1);

  /* a state byte outside the enum: counted as none of the states, nothing indexed by it */
  atomic_store(&line1->ack, fr_ctl_word(1, 0xff));
  ferry_ctl_status st = get_status(c);
  assert_false(st.agreed);

  /* the header's layout rewritten under an open controller: it keeps the layout it checked */
  hdr->nranks = 1u << 30;
  hdr->lines_offset = 0xfffff000u;
  hdr->file_size = 0xffffffffu;
  st = get_status(c);
  assert_int_equal(st.nranks, 2);
  FR_OK(ferry_ctl_rank_status_get(c, 1, &rs));
  assert_int_equal(ferry_ctl_rank_status_get(c, 2, &rs), FERRY_ERANGE);
  ferry_ctl *c2 = (ferry_ctl *)0x1;
  assert_int_equal(ferry_ctl_open(name, &c2), FERRY_EPROTO);
  assert_non_null(strstr(ferry_last_error(), "corrupt header"));
  ferry_ctl_rank *r2 = NULL;
  assert_int_equal(ferry_ctl_rank_open(name, 1, NULL, &r2), FERRY_EPROTO);

  munmap(file, FR_CTL_HEADER_BYTES + FR_CTL_PAGE);
  close(fd);
  ferry_ctl_rank_close(r0);
  ferry_ctl_rank_close(r1);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

/* Single-threaded rank API: a request with timeout 0 issues and returns at once. */
static void test_rank_api(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell));
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_EPEER);
  assert_non_null(strstr(ferry_last_error(), "rank 0 is not attached"));
  ferry_ctl_rank *r = NULL;
  assert_int_equal(ferry_ctl_rank_open(name, 1, NULL, &r), FERRY_ERANGE);
  FR_OK(ferry_ctl_rank_open(name, 0, NULL, &r));
  ferry_ctl_rank *twice = NULL;
  assert_int_equal(ferry_ctl_rank_open(name, 0, NULL, &twice), FERRY_EBUSY);
  ferry_ctl_command cmd;
  assert_int_equal(ferry_ctl_wait_command(r, 0, &cmd), FERRY_ETIMEDOUT);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 0), FERRY_ESTATE);
  assert_non_null(strstr(ferry_last_error(), "serving"));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_ETIMEDOUT);
  assert_int_equal(get_status(c).state, FERRY_CTL_CLEARING);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_EBUSY);
  FR_OK(ferry_ctl_wait_command(r, 0, &cmd));
  assert_int_equal(cmd.seq, 1);
  assert_int_equal(cmd.cmd, FERRY_CTL_CLEAR);
  assert_int_equal(ferry_ctl_ack(r, 1, FERRY_CTL_SERVING, 0, NULL), FERRY_ESTATE);
  assert_int_equal(ferry_ctl_ack(r, 2, FERRY_CTL_CLEARED, 0, NULL), FERRY_EINVAL);
  assert_int_equal(ferry_ctl_ack(r, 1, FERRY_CTL_FAILED, 0, NULL), FERRY_EINVAL);
  FR_OK(ferry_ctl_ack(r, 1, FERRY_CTL_CLEARED, 0, NULL));
  assert_int_equal(ferry_ctl_ack(r, 1, FERRY_CTL_CLEARED, 0, NULL), FERRY_ESTATE);
  ferry_ctl_status st = get_status(c);
  assert_int_equal(st.state, FERRY_CTL_CLEARED);
  assert_true(st.agreed && !st.in_flight);
  /* clear while cleared: done at once, nothing issued */
  FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0));
  assert_int_equal(get_status(c).seq, 1);
  /* a failed update, with its message */
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 0), FERRY_ETIMEDOUT);
  FR_OK(ferry_ctl_wait_command(r, 0, &cmd));
  FR_OK(ferry_ctl_ack(r, cmd.seq, FERRY_CTL_FAILED, FERRY_ECHECKSUM, "bucket 3 corrupt"));
  ferry_ctl_rank_status rs = {.size = sizeof rs};
  FR_OK(ferry_ctl_rank_status_get(c, 0, &rs));
  assert_int_equal(rs.state, FERRY_CTL_FAILED);
  assert_int_equal(rs.error, FERRY_ECHECKSUM);
  assert_string_equal(rs.message, "bucket 3 corrupt");
  assert_int_equal(rs.pid, getpid());
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 0), FERRY_ESTATE);
  assert_non_null(strstr(ferry_last_error(), "failed"));
  ferry_ctl_rank_close(r);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

/* The options-struct rule at the public calls: a size never set is refused with nothing made, a
 * field beyond the caller's size takes its default, a newer caller's unknown field is refused. */
static void test_opts_size_rule(void **state) {
  ferry_ctl_cell *cell = NULL;
  ferry_ctl_cell_opts unset = {.fail_if_stale = 1};
  assert_int_equal(ferry_ctl_cell_create(name, 1, &unset, &cell), FERRY_EINVAL);
  assert_non_null(strstr(ferry_last_error(), "ferry_ctl_cell_create: opts->size is 0"));
  ferry_ctl *c = NULL;
  assert_int_equal(ferry_ctl_open(name, &c), FERRY_ENOTFOUND);
  struct {
    ferry_ctl_cell_opts known;
    uint64_t later_field;
  } newer = {{.size = sizeof newer}, 1};
  assert_int_equal(ferry_ctl_cell_create(name, 1, &newer.known, &cell), FERRY_ENOTSUP);
  newer.later_field = 0;
  FR_OK(ferry_ctl_cell_create(name, 1, &newer.known, &cell));
  FR_OK(ferry_ctl_open(name, &c));
  /* initial_state beyond this caller's size: the default (serving), not the value it lacks */
  ferry_ctl_rank_opts older = {.size = offsetof(ferry_ctl_rank_opts, initial_state),
                               .initial_state = FERRY_CTL_CLEARED};
  ferry_ctl_rank *r = NULL;
  FR_OK(ferry_ctl_rank_open(name, 0, &older, &r));
  ferry_ctl_rank_status rs = {.size = sizeof rs};
  FR_OK(ferry_ctl_rank_status_get(c, 0, &rs));
  assert_int_equal(rs.state, FERRY_CTL_SERVING);
  ferry_ctl_rank_close(r);
  ferry_ctl_rank_opts full = {.size = sizeof full, .initial_state = FERRY_CTL_CLEARED};
  FR_OK(ferry_ctl_rank_open(name, 0, &full, &r));
  FR_OK(ferry_ctl_rank_status_get(c, 0, &rs));
  assert_int_equal(rs.state, FERRY_CTL_CLEARED);
  ferry_ctl_handlers h = {.size = 0};
  assert_int_equal(ferry_ctl_rank_step(r, &h, 0, NULL), FERRY_EINVAL);
  h.size = sizeof h;
  assert_int_equal(ferry_ctl_rank_step(r, &h, 0, NULL), FERRY_ETIMEDOUT);
  ferry_ctl_rank_close(r);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

/* Files another user plants under a cell's name in the shared FERRY_CTL_DIR (issue 32 row 2):
 * a FIFO no longer blocks an engine's create for ever, a link is never opened (the file it names
 * stays as it was), and a well-formed cell of another user's (as root: chown 65534) is refused.
 * Each is refused at once naming what is there, and ferry_ctl_gc skips them all. */
static void test_planted_cell_files(void **state) {
  char path[256], victim[256], text[32] = "";
  snprintf(path, sizeof path, "%s/ferry-ctl-%s", dir, name);
  snprintf(victim, sizeof victim, "%s/victim-%s", dir, name);
  ferry_ctl_cell *cell = NULL;
  ferry_ctl *c = NULL;
  ferry_ctl_rank *r = NULL;
  assert_int_equal(mkfifo(path, 0666), 0);
  assert_int_equal(ferry_ctl_cell_create(name, 1, NULL, &cell), FERRY_EEXIST);
  assert_non_null(strstr(ferry_last_error(), "a FIFO"));
  assert_int_equal(ferry_ctl_open(name, &c), FERRY_EACCES);
  assert_non_null(strstr(ferry_last_error(), "a FIFO"));
  assert_true(ferry_ctl_gc(0, NULL, NULL) >= 0);
  assert_int_equal(access(path, F_OK), 0); /* skipped, not removed */
  assert_int_equal(unlink(path), 0);

  FILE *f = fopen(victim, "w");
  assert_non_null(f);
  fputs("precious\n", f);
  fclose(f);
  assert_int_equal(symlink(victim, path), 0);
  assert_int_equal(ferry_ctl_cell_create(name, 1, NULL, &cell), FERRY_EEXIST);
  assert_non_null(strstr(ferry_last_error(), "symbolic link"));
  assert_int_equal(ferry_ctl_rank_open(name, 0, NULL, &r), FERRY_EACCES);
  assert_non_null(strstr(ferry_last_error(), "symbolic link"));
  assert_true(ferry_ctl_gc(0, NULL, NULL) >= 0);
  f = fopen(victim, "r");
  assert_non_null(f);
  assert_non_null(fgets(text, sizeof text, f));
  fclose(f);
  assert_string_equal(text, "precious\n");
  assert_int_equal(unlink(path), 0);
  unlink(victim);

  if (geteuid() != 0)
    return; /* another user's file needs root to make (CI runs as root) */
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell));
  assert_int_equal(chown(path, 65534, 65534), 0);
  assert_int_equal(ferry_ctl_open(name, &c), FERRY_EACCES);
  assert_non_null(strstr(ferry_last_error(), "owned by uid 65534"));
  assert_int_equal(ferry_ctl_rank_open(name, 0, NULL, &r), FERRY_EACCES);
  ferry_ctl_cell_close(cell);
  unlink(path);
}

/* The lost-update regression, part 1: a rank that lags behind several commands gets the newest,
 * and nothing a controller issued was overwritten. */
static void test_lagging_rank_sees_latest(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell));
  ferry_ctl_rank *r = NULL;
  FR_OK(ferry_ctl_rank_open(name, 0, NULL, &r));
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_ETIMEDOUT);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_ABORT, 0), FERRY_ETIMEDOUT);
  ferry_ctl_command cmd;
  FR_OK(ferry_ctl_wait_command(r, 0, &cmd));
  assert_int_equal(cmd.seq, 2);
  assert_int_equal(cmd.cmd, FERRY_CTL_ABORT);
  FR_OK(ferry_ctl_ack(r, 2, FERRY_CTL_SERVING, 0, NULL));
  ferry_ctl_status st = get_status(c);
  assert_true(!st.in_flight && st.agreed && st.state == FERRY_CTL_SERVING);
  ferry_ctl_rank_close(r);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

/* A rank between claiming its line and publishing its initial state (its ack word still reads
 * ABSENT) when the first command comes: nothing is in flight before seq 1, so the command is
 * issued (the rank takes it once attached), not refused as "none seq 0 in flight". */
static void test_first_command_while_rank_attaching(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  ferry_ctl_rank *r = NULL;
  FR_OK(ferry_ctl_rank_open(name, 0, NULL, &r));
  fr_ctl_map m; /* rank 1, half attached: the owner word set, the ack word not yet */
  FR_OK(fr_ctl_map_open(name, FR_CTL_MAP_ENGINE, &m));
  atomic_store(&m.lines[1].owner, fr_ctl_owner(getpid(), fr_ctl_pid_start(getpid())));
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  ferry_ctl_status st = get_status(c);
  assert_true(!st.in_flight && st.seq == 0 && st.state == FERRY_CTL_ABSENT);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_ETIMEDOUT); /* issued */
  st = get_status(c);
  assert_true(st.in_flight && st.seq == 1 && st.state == FERRY_CTL_CLEARING);
  fr_ctl_map_close(&m);
  ferry_ctl_rank_close(r);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

static void on_segv(int sig) { _exit(42); }

static int rank_writes_command(void *arg) {
  struct sigaction sa = {.sa_handler = on_segv};
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  fr_ctl_map map;
  if (fr_ctl_map_open(name, FR_CTL_MAP_RANK, &map) != 0)
    return 1;
  atomic_store(&map.hdr->command, fr_ctl_word(99, FERRY_CTL_UPDATE)); /* must fault */
  return 0;
}

/* The lost-update regression, part 2: a rank has no way to write the command word. */
static void test_rank_cannot_write_command(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell));
  int st = tu_wait(tu_spawn(rank_writes_command, NULL));
  assert_true(st == 42 || st == 128 + SIGSEGV);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  assert_int_equal(get_status(c).seq, 0);
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

static void test_cycle_processes(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 4, NULL, &cell));
  ranks rs;
  start_ranks(&rs, 4, NULL);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  for (int i = 0; i < 3; i++) {
    FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000));
    ferry_ctl_status st = get_status(c);
    assert_true(st.state == FERRY_CTL_CLEARED && st.agreed);
    FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000)); /* at once */
    FR_OK(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000));
    assert_int_equal(get_status(c).state, FERRY_CTL_SERVING);
    assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000), FERRY_ESTATE);
  }
  assert_int_equal(get_status(c).seq, 6);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  for (int i = 0; i < 4; i++)
    assert_int_equal(atomic_load(&sh->handled[i]), 6);
  assert_int_equal(atomic_load(&sh->gaps), 0);
  ferry_ctl_cell_close(cell);
}

static void test_rank_failure_and_recovery(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 3, NULL, &cell));
  rank_cfg cfg[3] = {{.gate_rd = -1, .note_wr = -1},
                     {.fail_update = FERRY_ECHECKSUM, .gate_rd = -1, .note_wr = -1},
                     {.gate_rd = -1, .note_wr = -1}};
  ranks rs;
  start_ranks(&rs, 3, cfg);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000), FERRY_ECHECKSUM);
  assert_non_null(strstr(ferry_last_error(), "rank 1 failed"));
  assert_null(strstr(ferry_last_error(), "rank 0"));
  ferry_ctl_status st = get_status(c);
  assert_int_equal(st.state, FERRY_CTL_FAILED);
  assert_false(st.agreed);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000), FERRY_ESTATE);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000)); /* the way back from FAILED */
  assert_int_equal(get_status(c).state, FERRY_CTL_CLEARED);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  ferry_ctl_cell_close(cell);
}

typedef struct ctl_args {
  int requests;
  unsigned seed;
} ctl_args;

/* A controller process: random commands; counts outcomes in shared memory. */
static int controller_child(void *p) {
  ctl_args *a = p;
  ferry_ctl *c = NULL;
  if (ferry_ctl_open(name, &c) != 0)
    return 1;
  for (int i = 0; i < a->requests; i++) {
    ferry_ctl_cmd cmd = rand_r(&a->seed) % 2 ? FERRY_CTL_CLEAR : FERRY_CTL_UPDATE;
    int rc = ferry_ctl_request(c, cmd, 20000);
    if (rc == FERRY_EBUSY)
      atomic_fetch_add(&sh->busy, 1);
    else if (rc == FERRY_ETIMEDOUT)
      atomic_fetch_add(&sh->timeouts, 1);
    else if (rc != 0 && rc != FERRY_ESTATE) {
      fprintf(stderr, "controller: %s: %s\n", ferry_status_name(rc), ferry_last_error());
      atomic_fetch_add(&sh->errors, 1);
    }
  }
  ferry_ctl_close(c);
  return 0;
}

static void test_concurrent_controllers(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 4, NULL, &cell));
  ranks rs;
  start_ranks(&rs, 4, NULL);
  ctl_args a[3] = {{300, 1}, {300, 2}, {300, 3}};
  pid_t pids[3];
  for (int i = 0; i < 3; i++)
    pids[i] = tu_spawn(controller_child, &a[i]);
  for (int i = 0; i < 3; i++)
    assert_int_equal(tu_wait(pids[i]), 0);
  assert_int_equal(atomic_load(&sh->timeouts), 0);
  assert_int_equal(atomic_load(&sh->errors), 0);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  ferry_ctl_status st = get_status(c);
  assert_true(st.agreed && !st.in_flight);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  /* every issued command reached every rank, in order */
  for (int i = 0; i < 4; i++)
    assert_int_equal(atomic_load(&sh->handled[i]), st.seq);
  assert_int_equal(atomic_load(&sh->gaps), 0);
  ferry_ctl_cell_close(cell);
}

/* ---- the stress test: 8 ranks (4 processes + 4 threads of a fifth), two controllers ---- */

static int thread_ranks_child(void *p) {
  rank_cfg *cfg = p;
  pthread_t t[4];
  for (int i = 0; i < 4; i++)
    assert_int_equal(pthread_create(&t[i], NULL, rank_thread, &cfg[i]), 0);
  int bad = 0;
  for (int i = 0; i < 4; i++) {
    void *rc;
    pthread_join(t[i], &rc);
    bad |= rc != NULL;
  }
  return bad;
}

static void stress_count(int rc, unsigned *seed) {
  if (rc == FERRY_EBUSY) {
    atomic_fetch_add(&sh->busy, 1);
    random_pause(seed);
  } else if (rc == FERRY_ETIMEDOUT) {
    atomic_fetch_add(&sh->timeouts, 1);
  } else if (rc != 0 && rc != FERRY_ESTATE) {
    fprintf(stderr, "stress controller: %s: %s\n", ferry_status_name(rc), ferry_last_error());
    atomic_fetch_add(&sh->errors, 1);
  }
}

/* Clear then update, again and again, racing the other controller. */
static int stress_controller(void *p) {
  ctl_args *a = p;
  ferry_ctl *c = NULL;
  if (ferry_ctl_open(name, &c) != 0)
    return 1;
  while (atomic_load(&sh->cycles) < (uint64_t)a->requests) {
    stress_count(ferry_ctl_request(c, FERRY_CTL_CLEAR, 20000), &a->seed);
    int rc = ferry_ctl_request(c, FERRY_CTL_UPDATE, 20000);
    if (rc == 0)
      atomic_fetch_add(&sh->cycles, 1);
    stress_count(rc, &a->seed);
  }
  ferry_ctl_close(c);
  return 0;
}

static void test_stress_no_lost_command(void **state) {
  const char *env = getenv("FERRY_CTL_STRESS_CYCLES");
  int cycles = env ? atoi(env) : STRESS_CYCLES_DEFAULT;
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 8, NULL, &cell));
  ranks rs = {.n = 5};
  rank_cfg cfg[8];
  for (int i = 0; i < 8; i++)
    cfg[i] = (rank_cfg){.rank = (uint32_t)i, .gate_rd = -1, .note_wr = -1, .random_delay = true};
  for (int i = 0; i < 4; i++)
    rs.pid[i] = tu_spawn(rank_child, &cfg[i]);
  rs.pid[4] = tu_spawn(thread_ranks_child, &cfg[4]);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  wait_attached(c, 8);
  ctl_args a[2] = {{cycles, 11}, {cycles, 12}};
  pid_t p0 = tu_spawn(stress_controller, &a[0]), p1 = tu_spawn(stress_controller, &a[1]);
  assert_int_equal(tu_wait(p0), 0);
  assert_int_equal(tu_wait(p1), 0);
  ferry_ctl_status st = get_status(c);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  print_message("stress: %lu cycles, %lu commands, %lu busy, 8 ranks, 2 controllers\n",
                (unsigned long)atomic_load(&sh->cycles), (unsigned long)st.seq,
                (unsigned long)atomic_load(&sh->busy));
  assert_int_equal(atomic_load(&sh->timeouts), 0);
  assert_int_equal(atomic_load(&sh->errors), 0);
  assert_int_equal(atomic_load(&sh->gaps), 0);
  assert_true(atomic_load(&sh->cycles) >= (uint64_t)cycles);
  for (int i = 0; i < 8; i++)
    assert_int_equal(atomic_load(&sh->handled[i]), st.seq);
  assert_true(st.agreed && st.state == FERRY_CTL_SERVING);
  ferry_ctl_cell_close(cell);
}

/* ---- crashes ---- */

static void test_dead_rank_named(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 3, NULL, &cell));
  ranks rs;
  start_ranks(&rs, 3, NULL);
  kill(rs.pid[1], SIGKILL); /* a zombie until reaped: it must count as dead all the same */
  for (int i = 0; i < 5000 && fr_ctl_pid_alive(rs.pid[1], 0); i++)
    usleep(1000); /* until it is a zombie: a request made before that may be issued */
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000), FERRY_EPEER);
  assert_non_null(strstr(ferry_last_error(), "rank 1"));
  assert_non_null(strstr(ferry_last_error(), "dead"));
  ferry_ctl_status cs = get_status(c); /* refused up front, the zombie too: nothing was issued */
  assert_int_equal(cs.seq, 0);
  assert_false(cs.in_flight);
  ferry_ctl_rank_status st = {.size = sizeof st};
  FR_OK(ferry_ctl_rank_status_get(c, 1, &st));
  assert_false(st.alive);
  ferry_ctl_close(c);
  assert_int_equal(tu_wait(rs.pid[1]), 128 + SIGKILL);
  kill(rs.pid[0], SIGKILL);
  kill(rs.pid[2], SIGKILL);
  tu_wait(rs.pid[0]);
  tu_wait(rs.pid[2]);
  ferry_ctl_cell_close(cell);
}

static int request_child(void *p) {
  ferry_ctl *c = NULL;
  if (ferry_ctl_open(name, &c) != 0)
    return 1;
  int rc = ferry_ctl_request(c, *(ferry_ctl_cmd *)p, 20000);
  ferry_ctl_close(c);
  return -rc; /* the status as the exit code */
}

/* A rank dies while the controller waits for it: the request fails naming it. */
static void test_rank_dies_mid_request(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  tu_pipe gate, note;
  tu_pipe_open(&gate);
  tu_pipe_open(&note);
  rank_cfg cfg[2] = {{.gate_rd = -1, .note_wr = -1},
                     {.hold = FERRY_CTL_CLEAR, .gate_rd = gate.rd, .note_wr = note.wr}};
  ranks rs;
  start_ranks(&rs, 2, cfg);
  ferry_ctl_cmd cmd = FERRY_CTL_CLEAR;
  pid_t ctl = tu_spawn(request_child, &cmd);
  char b;
  assert_int_equal(tu_pipe_get(&note, &b, 1, 10000), 0); /* rank 1 is inside its clear */
  kill(rs.pid[1], SIGKILL);
  assert_int_equal(tu_wait(ctl), -FERRY_EPEER);
  tu_wait(rs.pid[1]);
  kill(rs.pid[0], SIGKILL);
  tu_wait(rs.pid[0]);
  tu_pipe_close(&gate);
  tu_pipe_close(&note);
  ferry_ctl_cell_close(cell);
}

static double ms_since(const struct timespec *t0) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)(t.tv_sec - t0->tv_sec) * 1e3 + (double)(t.tv_nsec - t0->tv_nsec) / 1e6;
}

#define HANG_MS 10000.0 /* far above a 1 s request plus its constant: only a hang gets there */

/* A rank stopped (SIGSTOP) before a request: it is alive, so nothing fails it early; the request
 * times out naming that rank alone (the others acked: unaffected); another controller is told
 * the command is in flight. After SIGCONT the rank takes the command still in the cell and
 * acks it, the cell agrees again and the next command goes through; no rank lost a command. */
static void test_rank_stopped(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 3, NULL, &cell));
  ranks rs;
  start_ranks(&rs, 3, NULL);
  assert_int_equal(kill(rs.pid[1], SIGSTOP), 0);
  int wst = 0;
  assert_int_equal(waitpid(rs.pid[1], &wst, WUNTRACED), rs.pid[1]);
  assert_true(WIFSTOPPED(wst));
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = ferry_ctl_request(c, FERRY_CTL_CLEAR, 1000);
  double ms = ms_since(&t0);
  char why[512];
  snprintf(why, sizeof why, "%s", ferry_last_error());
  ferry_ctl_rank_status st[3];
  for (uint32_t i = 0; i < 3; i++) {
    st[i] = (ferry_ctl_rank_status){.size = sizeof st[i]};
    FR_OK(ferry_ctl_rank_status_get(c, i, &st[i]));
  }
  int busy = ferry_ctl_request(c, FERRY_CTL_UPDATE, 1000);
  kill(rs.pid[1], SIGCONT);
  printf("# rank 1 stopped: clear with a 1000 ms timeout returned %s after %.0f ms: %s\n",
         ferry_status_name(rc), ms, why);
  assert_int_equal(rc, FERRY_ETIMEDOUT);
  assert_true(ms < HANG_MS);
  assert_non_null(strstr(why, "rank 1"));
  assert_null(strstr(why, "rank 0"));
  assert_null(strstr(why, "rank 2"));
  assert_true(st[0].alive && st[0].state == FERRY_CTL_CLEARED && st[0].seq == 1);
  assert_true(st[2].alive && st[2].state == FERRY_CTL_CLEARED && st[2].seq == 1);
  assert_true(st[1].alive); /* stopped is not dead */
  assert_int_equal(busy, FERRY_EBUSY);
  /* resumed: the rank takes the clear still in the cell (polled with a bound, no timing) */
  ferry_ctl_rank_status r1 = {.size = sizeof r1};
  for (int i = 0; i < 20000; i++) {
    FR_OK(ferry_ctl_rank_status_get(c, 1, &r1));
    if (r1.state == FERRY_CTL_CLEARED && r1.seq == 1)
      break;
    usleep(1000);
  }
  assert_true(r1.state == FERRY_CTL_CLEARED && r1.seq == 1);
  ferry_ctl_status cs = get_status(c);
  assert_true(!cs.in_flight && cs.agreed && cs.state == FERRY_CTL_CLEARED);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000));
  assert_int_equal(get_status(c).state, FERRY_CTL_SERVING);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  for (int i = 0; i < 3; i++)
    assert_int_equal(atomic_load(&sh->handled[i]), 2);
  assert_int_equal(atomic_load(&sh->gaps), 0);
  ferry_ctl_cell_close(cell);
}

/* A controller killed mid-request leaves a consistent cell; the ranks finish; the next
 * controller proceeds. */
static void test_controller_killed_mid_request(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  tu_pipe gate, note;
  tu_pipe_open(&gate);
  tu_pipe_open(&note);
  rank_cfg cfg[2];
  for (int i = 0; i < 2; i++)
    cfg[i] = (rank_cfg){.hold = FERRY_CTL_CLEAR, .gate_rd = gate.rd, .note_wr = note.wr};
  ranks rs;
  start_ranks(&rs, 2, cfg);
  ferry_ctl_cmd cmd = FERRY_CTL_CLEAR;
  pid_t ctl = tu_spawn(request_child, &cmd);
  char b[2];
  assert_int_equal(tu_pipe_get(&note, b, 2, 10000), 0); /* both ranks are clearing */
  kill(ctl, SIGKILL);
  assert_int_equal(tu_wait(ctl), 128 + SIGKILL);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  ferry_ctl_status st = get_status(c);
  assert_true(st.in_flight && st.state == FERRY_CTL_CLEARING && st.seq == 1);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 1000), FERRY_EBUSY);
  assert_non_null(strstr(ferry_last_error(), "in flight"));
  tu_pipe_put(&gate, "gg", 2); /* the ranks finish the dead controller's command */
  ferry_ctl_rank_status rst = {.size = sizeof rst};
  for (uint32_t i = 0; i < 2; i++)
    do
      FR_OK(ferry_ctl_rank_status_get(c, i, &rst));
    while (rst.state != FERRY_CTL_CLEARED && (sched_yield(), 1));
  st = get_status(c);
  assert_true(!st.in_flight && st.agreed && st.state == FERRY_CTL_CLEARED);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000));
  ferry_ctl_close(c);
  stop_ranks(&rs);
  tu_pipe_close(&gate);
  tu_pipe_close(&note);
  ferry_ctl_cell_close(cell);
}

/* A controller gave up (timeout); abort supersedes its command and the ranks report back. */
static void test_abort_in_flight(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  tu_pipe gate, note;
  tu_pipe_open(&gate);
  tu_pipe_open(&note);
  rank_cfg cfg[2]; /* both take the clear and hold it (a rank that had not taken it yet would
                      rightly skip it for the abort, leaving the ranks in different states) */
  for (int i = 0; i < 2; i++)
    cfg[i] = (rank_cfg){.hold = FERRY_CTL_CLEAR, .gate_rd = gate.rd, .note_wr = note.wr};
  ranks rs;
  start_ranks(&rs, 2, cfg);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 0), FERRY_ETIMEDOUT);
  char b[2];
  assert_int_equal(tu_pipe_get(&note, b, 2, 10000), 0);
  tu_pipe_put(&gate, "gg", 2); /* the abort may be issued before or after they finish */
  FR_OK(ferry_ctl_request(c, FERRY_CTL_ABORT, 10000));
  ferry_ctl_status st = get_status(c);
  assert_int_equal(st.seq, 2);
  assert_true(!st.in_flight && st.state == FERRY_CTL_CLEARED);
  ferry_ctl_close(c);
  stop_ranks(&rs);
  tu_pipe_close(&gate);
  tu_pipe_close(&note);
  ferry_ctl_cell_close(cell);
}

static int engine_dies(void *p) {
  ferry_ctl_cell *cell = NULL;
  if (ferry_ctl_cell_create(name, 1, NULL, &cell) != 0)
    return 1;
  _exit(0); /* no close: the cell stays behind */
}

static void test_stale_cell(void **state) {
  assert_int_equal(tu_wait(tu_spawn(engine_dies, NULL)), 0);
  ferry_ctl *old = NULL;
  FR_OK(ferry_ctl_open(name, &old));
  ferry_ctl_status st = get_status(old);
  assert_false(st.engine_alive);
  assert_int_equal(st.incarnation, 1);
  assert_int_equal(ferry_ctl_request(old, FERRY_CTL_CLEAR, 1000), FERRY_ESTALE);
  assert_non_null(strstr(ferry_last_error(), "is dead"));
  ferry_ctl_cell *cell = NULL;
  ferry_ctl_cell_opts strict = {.size = sizeof strict, .fail_if_stale = 1};
  assert_int_equal(ferry_ctl_cell_create(name, 1, &strict, &cell), FERRY_ESTALE);
  FR_OK(ferry_ctl_cell_create(name, 1, NULL, &cell)); /* the restart: a new incarnation */
  assert_int_equal(ferry_ctl_cell_incarnation(cell), 2);
  assert_int_equal(ferry_ctl_request(old, FERRY_CTL_CLEAR, 1000), FERRY_ESTALE);
  assert_non_null(strstr(ferry_last_error(), "replaced"));
  ferry_ctl_close(old);
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  st = get_status(c);
  assert_true(st.engine_alive && st.incarnation == 2);
  ferry_ctl_cell_close(cell);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_CLEAR, 1000), FERRY_ENOTFOUND);
  ferry_ctl_close(c);
}

/* ---- the refit pattern: the receiver's commit is the step that ends UPDATING ---- */

#define BUCKETS 4
#define BUCKET_BYTES 256
typedef struct fake_push { /* what a sender's push leaves for a receiver */
  uint64_t version;
  uint8_t data[BUCKETS][BUCKET_BYTES];
  uint64_t sum[BUCKETS];
} fake_push;

/* The stand-in transport's own synchronization (refit has its own). */
static pthread_mutex_t push_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct fake_receiver {
  const fake_push *incoming;
  uint8_t weights[BUCKETS][BUCKET_BYTES];
  uint64_t serving_version; /* 0: none (cleared) */
  uint32_t rank;
} fake_receiver;

/* Stand-in for a refit receiver's commit: verify every bucket, then switch versions. */
static int fake_commit(void *p) {
  fake_receiver *r = p;
  int rc = 0;
  pthread_mutex_lock(&push_lock);
  for (int b = 0; b < BUCKETS && rc == 0; b++)
    if (ferry_checksum(r->incoming->data[b], BUCKET_BYTES) != r->incoming->sum[b])
      rc = FERRY_ECHECKSUM;
  if (rc == 0) {
    memcpy(r->weights, r->incoming->data, sizeof r->weights);
    r->serving_version = r->incoming->version;
  }
  pthread_mutex_unlock(&push_lock);
  return rc;
}

static int fake_clear(void *p) {
  ((fake_receiver *)p)->serving_version = 0;
  return 0;
}

static void *refit_rank(void *p) {
  fake_receiver *fr = p;
  ferry_ctl_rank *r = NULL;
  if (ferry_ctl_rank_open(name, fr->rank, NULL, &r) != 0)
    return (void *)1;
  ferry_ctl_handlers h = {sizeof h, fake_clear, fake_commit, NULL, fr};
  ferry_ctl_command cmd = {0};
  while (cmd.cmd != FERRY_CTL_ABORT) /* the test ends with an abort */
    if (ferry_ctl_rank_step(r, &h, 10000, &cmd) != 0)
      break;
  ferry_ctl_rank_close(r);
  return NULL;
}

static void make_push(fake_push *push, uint64_t version, bool corrupt) {
  pthread_mutex_lock(&push_lock);
  push->version = version;
  for (int b = 0; b < BUCKETS; b++) {
    tu_fill(push->data[b], BUCKET_BYTES, version * 10 + (uint64_t)b);
    push->sum[b] = ferry_checksum(push->data[b], BUCKET_BYTES);
  }
  if (corrupt)
    push->data[3][17] ^= 1;
  pthread_mutex_unlock(&push_lock);
}

static void test_refit_commit_ends_updating(void **state) {
  ferry_ctl_cell *cell = NULL;
  FR_OK(ferry_ctl_cell_create(name, 2, NULL, &cell));
  static fake_push push;
  make_push(&push, 1, false);
  fake_receiver rx[2] = {{&push, {{0}}, 1, 0}, {&push, {{0}}, 1, 1}};
  pthread_t t[2];
  ferry_ctl *c = NULL;
  FR_OK(ferry_ctl_open(name, &c));
  for (int i = 0; i < 2; i++)
    assert_int_equal(pthread_create(&t[i], NULL, refit_rank, &rx[i]), 0);
  wait_attached(c, 2);
  /* version 2 arrives corrupted: the commit fails, the engine does not serve it */
  FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000));
  make_push(&push, 2, true);
  assert_int_equal(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000), FERRY_ECHECKSUM);
  assert_int_equal(get_status(c).state, FERRY_CTL_FAILED);
  /* a clean re-push: SERVING only with the verified version */
  FR_OK(ferry_ctl_request(c, FERRY_CTL_CLEAR, 10000));
  make_push(&push, 3, false);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_UPDATE, 10000));
  assert_int_equal(get_status(c).state, FERRY_CTL_SERVING);
  FR_OK(ferry_ctl_request(c, FERRY_CTL_ABORT, 10000));
  for (int i = 0; i < 2; i++) {
    void *rc;
    pthread_join(t[i], &rc);
    assert_null(rc);
    assert_int_equal(rx[i].serving_version, 3);
    pthread_mutex_lock(&push_lock);
    assert_memory_equal(rx[i].weights, push.data, sizeof rx[i].weights);
    pthread_mutex_unlock(&push_lock);
  }
  ferry_ctl_close(c);
  ferry_ctl_cell_close(cell);
}

int main(int argc, char **argv) {
#if defined(__SANITIZE_THREAD__)
  /* UCX's memory hooks (libucm, loaded with libferry) crash under TSan's interceptors when a
   * thread exits (its stack madvise). ctest turns them off (tests/CMakeLists.txt); do the same
   * when the binary is run by hand: the hooks are set up at load time, so re-exec. */
  if (!getenv("UCX_MEM_EVENTS") && argc >= 1) {
    setenv("UCX_MEM_EVENTS", "no", 1);
    setenv("UCX_MEM_MALLOC_HOOKS", "no", 1);
    execv("/proc/self/exe", argv);
  }
#endif
  (void)argc;
  (void)argv;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_names_and_args, setup, teardown),
      cmocka_unit_test(test_pid_start_time),
      cmocka_unit_test_setup_teardown(test_layout_and_mode, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_api, setup, teardown),
      cmocka_unit_test_setup_teardown(test_opts_size_rule, setup, teardown),
      cmocka_unit_test_setup_teardown(test_hostile_cell, setup, teardown),
      cmocka_unit_test_setup_teardown(test_planted_cell_files, setup, teardown),
      cmocka_unit_test_setup_teardown(test_lagging_rank_sees_latest, setup, teardown),
      cmocka_unit_test_setup_teardown(test_first_command_while_rank_attaching, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_cannot_write_command, setup, teardown),
      cmocka_unit_test_setup_teardown(test_cycle_processes, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_failure_and_recovery, setup, teardown),
      cmocka_unit_test_setup_teardown(test_concurrent_controllers, setup, teardown),
      cmocka_unit_test_setup_teardown(test_dead_rank_named, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_dies_mid_request, setup, teardown),
      cmocka_unit_test_setup_teardown(test_controller_killed_mid_request, setup, teardown),
      cmocka_unit_test_setup_teardown(test_rank_stopped, setup, teardown),
      cmocka_unit_test_setup_teardown(test_abort_in_flight, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stale_cell, setup, teardown),
      cmocka_unit_test_setup_teardown(test_refit_commit_ends_updating, setup, teardown),
      cmocka_unit_test_setup_teardown(test_stress_no_lost_command, setup, teardown),
  };
  tu_filter(); /* FERRY_TEST_ONLY, FERRY_TEST_SKIP */
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
