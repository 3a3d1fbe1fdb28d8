/*
 * Internal layout of a control cell and the helpers its three users share (engine, controller,
 * rank). The file is one header page followed by the rank lines:
 *
 *   page 0     header (immutable once published) | command word (controllers only)
 *   pages 1-8  the outcome log (controllers only)
 *   page 9..   one 64-byte line per rank, each written only by its rank
 *
 * Controllers map page 0 writable and the rank lines read-only; ranks map page 0 read-only and
 * the rank lines writable. So a rank cannot write the command word even by mistake: the
 * read-broadcast-writeback bug this design replaces is impossible, not merely avoided.
 *
 * Trust: the file is 0600, but any process of the user can open it and write any byte at any
 * time, so nothing in it is used as an index or a size unchecked:
 * - the header's layout (nranks, lines_offset, line_size, file_size) is read once with pread,
 *   checked (fr_ctl_header_check, fuzzed by fuzz/control_fuzz.c) and kept in fr_ctl_map; the
 *   mapping's sizes and every rank loop use that copy, never the mapped header again;
 * - the command word and ack words are read once into a local and only split into seq and a
 *   state masked to its bits (a state outside the enum counts as none of them);
 * - outcome slots are indexed by our seq modulo FR_CTL_OUTCOMES, never by a value read;
 * - a rank's failure record is copied word by word, its message NUL-terminated here, its error
 *   mapped to a ferry status (fr_ctl_rank_error);
 * - engine_pid/owner words only name a process to test for liveness.
 * What remains: a process that truncates the file makes the next touch of a mapped page raise
 * SIGBUS (a regular file cannot be sealed as a memfd can); only the user's own processes can.
 */
#ifndef FR_CONTROL_CELL_H
#define FR_CONTROL_CELL_H

#include "core/core.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define FR_CTL_MAGIC 0x4c54435952524546ull /* "FERRYCTL" in little-endian bytes */
#define FR_CTL_LAYOUT_VERSION 3u
#define FR_CTL_PAGE 4096u
#define FR_CTL_LINE 64u
#define FR_CTL_NAME_MAX 64

/* A rank's ack word: (seq << 8) | state. The futex lives on the low 32 bits, which change with
 * every write (the seq's low 24 bits and the state). */
static inline uint64_t fr_ctl_word(uint64_t seq, unsigned low) { return seq << 8 | (low & 0xff); }
static inline uint64_t fr_ctl_seq(uint64_t word) { return word >> 8; }
static inline unsigned fr_ctl_low(uint64_t word) { return (unsigned)(word & 0xff); }

/* The command word: (seq << 8) | command, in the same layout as an ack word. */
static inline uint64_t fr_ctl_cmd_word(uint64_t seq, unsigned cmd) { return fr_ctl_word(seq, cmd); }
static inline uint64_t fr_ctl_cmd_seq(uint64_t w) { return fr_ctl_seq(w); }
static inline unsigned fr_ctl_cmd_of(uint64_t w) { return fr_ctl_low(w) & 3; }

/* The outcome log: how each command ended, (seq << 8) | outcome in slot seq % FR_CTL_OUTCOMES.
 * Whoever issues the next command and finds this one complete records its outcome (a fact, so
 * concurrent writers agree; a slot only moves to a larger seq) before the compare-and-swap that
 * issues. So a controller preempted while others went on still learns how its own command
 * ended, even after every rank line has moved on; a command with no record was superseded by
 * an abort before all ranks acked (or, after FR_CTL_OUTCOMES newer commands, is unknown).
 * Layout 1 kept 256 and lost outcomes in the stress test: a controller preempted for ~100 ms on a
 * loaded machine while the other issued 298 commands; 4096 covers seconds of that. */
#define FR_CTL_OUTCOMES 4096
#define FR_CTL_OUTCOMES_OFFSET FR_CTL_PAGE
#define FR_CTL_HEADER_BYTES (FR_CTL_OUTCOMES_OFFSET + FR_CTL_OUTCOMES * 8)
enum {
  FR_CTL_OUT_UNKNOWN = 0,
  FR_CTL_OUT_OK = 1,
  FR_CTL_OUT_SUPERSEDED = 2,
  FR_CTL_OUT_FAILED = 3
};

typedef struct fr_ctl_header {
  uint64_t magic;
  uint32_t layout_version;
  uint32_t nranks;
  uint64_t incarnation;
  int32_t engine_pid;
  uint32_t lines_offset; /* byte offset of rank 0's line: FR_CTL_HEADER_BYTES */
  uint64_t engine_start; /* the engine's start time (/proc stat ticks): guards pid reuse */
  uint64_t created_unix_ns;
  uint32_t line_size; /* FR_CTL_LINE */
  uint32_t file_size;
  uint8_t reserved0[8];
  /* cache line 1: written only by controllers, with one atomic store or CAS */
  _Alignas(64) _Atomic uint64_t command;
  uint8_t reserved1[56];
  /* cache line 2, written only by controllers: how many sleep on an ack word right now. A rank
   * makes the FUTEX_WAKE system call after its ack only when this is non-zero (layout 3). */
  _Alignas(64) _Atomic uint64_t ack_waiters;
  uint8_t reserved2[FR_CTL_OUTCOMES_OFFSET - 136];
  /* written only by controllers */
  _Atomic uint64_t outcomes[FR_CTL_OUTCOMES];
} fr_ctl_header;

_Static_assert(offsetof(fr_ctl_header, magic) == 0, "magic first");
_Static_assert(offsetof(fr_ctl_header, nranks) == 12, "layout v1");
_Static_assert(offsetof(fr_ctl_header, incarnation) == 16, "layout v1");
_Static_assert(offsetof(fr_ctl_header, engine_pid) == 24, "layout v1");
_Static_assert(offsetof(fr_ctl_header, engine_start) == 32, "layout v1");
_Static_assert(offsetof(fr_ctl_header, file_size) == 52, "layout v1");
_Static_assert(offsetof(fr_ctl_header, command) == 64, "command word on its own cache line");
_Static_assert(offsetof(fr_ctl_header, ack_waiters) == 128, "layout v3");
_Static_assert(offsetof(fr_ctl_header, outcomes) == FR_CTL_OUTCOMES_OFFSET, "layout v2");
_Static_assert(sizeof(fr_ctl_header) == FR_CTL_HEADER_BYTES, "header: whole pages");
_Static_assert(FR_CTL_HEADER_BYTES % FR_CTL_PAGE == 0, "the rank lines start on a page");

#define FR_CTL_MSG_WORDS (FERRY_CTL_MESSAGE_MAX / 8)
typedef struct fr_ctl_line {
  _Atomic uint64_t ack;      /* (seq << 8) | ferry_ctl_state; the futex word */
  _Atomic uint64_t owner;    /* pid | (start time & 0xffffffff) << 32; 0: detached */
  _Atomic uint64_t fail_seq; /* the last command this rank failed (0: none, or being written) */
  _Atomic int32_t error;     /* ... its status */
  uint32_t reserved;
  _Atomic uint64_t message[FR_CTL_MSG_WORDS]; /* ... and NUL-terminated text, 8 bytes a store */
} fr_ctl_line;

_Static_assert(FERRY_CTL_MESSAGE_MAX % 8 == 0, "message is whole words");
_Static_assert(offsetof(fr_ctl_line, ack) == 0, "ack word first");
_Static_assert(offsetof(fr_ctl_line, owner) == 8, "layout v1");
_Static_assert(offsetof(fr_ctl_line, fail_seq) == 16, "layout v1");
_Static_assert(offsetof(fr_ctl_line, error) == 24, "layout v1");
_Static_assert(offsetof(fr_ctl_line, message) == 32, "layout v1");
_Static_assert(sizeof(fr_ctl_line) == FR_CTL_LINE, "one cache line per rank");
_Static_assert(sizeof(_Atomic uint64_t) == 8 && sizeof(_Atomic int32_t) == 4, "lock-free sizes");

/* A rank line's owner word: pid and the low half of its start time, in one atomic. */
static inline uint64_t fr_ctl_owner(pid_t pid, uint64_t start) {
  return (uint64_t)(uint32_t)pid | (start & 0xffffffffull) << 32;
}
static inline pid_t fr_ctl_owner_pid(uint64_t owner) { return (pid_t)(uint32_t)owner; }
static inline uint64_t fr_ctl_owner_start(uint64_t owner) { return owner >> 32; }

/* A mapped cell: page 0 and the lines, each with its own protection. */
typedef struct fr_ctl_map {
  int fd;
  fr_ctl_header *hdr;
  fr_ctl_line *lines;
  size_t lines_len;
  uint32_t nranks;
  uint64_t incarnation;
  dev_t dev;
  ino_t ino;
  char name[FR_CTL_NAME_MAX + 1];
  char path[FR_CTL_NAME_MAX + 256];
} fr_ctl_map;

enum { FR_CTL_MAP_CONTROLLER, FR_CTL_MAP_RANK, FR_CTL_MAP_ENGINE };

/* Validates a name and builds FERRY_CTL_DIR/ferry-ctl-NAME into map->path and map->name. */
int fr_ctl_path(const char *name, fr_ctl_map *map);
/* Opens an existing cell file and maps it for `role`: validates header and size. */
int fr_ctl_map_open(const char *name, int role, fr_ctl_map *map);
/* Maps an already open, fully sized cell file (used by create). */
int fr_ctl_map_fd(fr_ctl_map *map, int role);
void fr_ctl_map_close(fr_ctl_map *map);
/* Checks that the mapped cell is still the one under its name: FERRY_ENOTFOUND (removed),
 * FERRY_ESTALE (replaced by another incarnation). */
int fr_ctl_map_current(const fr_ctl_map *map);
/* FERRY_ESTALE when the cell's engine is dead. */
int fr_ctl_engine_check(const fr_ctl_map *map);
/* A rank line's error word as the status a controller reports: the rank's own when it is a
 * ferry status, else FERRY_EPEER (a rank, or any process of the user, may write any value). */
int fr_ctl_rank_error(int32_t raw);

/* Layout checks of a header read from a file of `file_size` bytes. */
int fr_ctl_header_check(const fr_ctl_header *hdr, uint64_t file_size, const char *name);

/* Liveness by pid and start time; a zombie counts as dead. start 0: pid only. owner_alive
 * checks a rank line's owner word (its start time's low 32 bits). */
bool fr_ctl_pid_alive(pid_t pid, uint64_t start);
bool fr_ctl_owner_alive(uint64_t owner);
/* kill(pid, 0) only: cheap, but a zombie or a reused pid counts as alive. */
bool fr_ctl_pid_exists(pid_t pid);
uint64_t fr_ctl_pid_start(pid_t pid);

/* A process watched through a pidfd, opened once per owner word (pid and start time, checked
 * in /proc when opened), so that one poll() then tells which of many watched processes exited
 * (zombies included) instead of a kill() each (2.4 us a system call on the project's VM: nine
 * of them were a quarter of an 8-rank request). Without pidfds (old kernels, too many ranks)
 * kill(pid, 0) stands in. */
typedef struct fr_ctl_watch {
  uint64_t owner; /* what fd watches; 0: nothing */
  int fd; /* the pidfd; FR_CTL_WATCH_KILL: use kill(); FR_CTL_WATCH_DEAD: dead when opened */
} fr_ctl_watch;
#define FR_CTL_WATCH_KILL (-1)
#define FR_CTL_WATCH_DEAD (-2)
/* Points w at `owner` (a rank line's owner word, fr_ctl_owner()); a no-op when it already is.
 * `use_pidfd` false: no descriptor is opened (kill() stands in). */
void fr_ctl_watch_set(fr_ctl_watch *w, uint64_t owner, bool use_pidfd);
void fr_ctl_watch_close(fr_ctl_watch *w);
/* dead[i] = whether the process of w[i] exited (false where w[i] watches nothing): one poll()
 * for all. */
void fr_ctl_watch_poll(const fr_ctl_watch *w, size_t n, bool *dead);

/* Futex on the low 32 bits of a shared 64-bit word (shared, not private: cells are mapped by
 * several processes). wait returns when the word's low half differs from `seen`, on a wake, or
 * after timeout_ms; the caller re-reads the word either way. */
void fr_ctl_futex_wait(_Atomic uint64_t *word, uint64_t seen, int timeout_ms);
void fr_ctl_futex_wake(_Atomic uint64_t *word);

static inline bool fr_ctl_state_terminal(unsigned s) {
  return s == FERRY_CTL_SERVING || s == FERRY_CTL_CLEARED || s == FERRY_CTL_FAILED;
}

/* metrics.c: counts a control request that ended with rc and began at t0 (process-wide). */
void fr_ctl_count_request(ferry_ctl_cmd cmd, int rc, uint64_t t0);

#endif
