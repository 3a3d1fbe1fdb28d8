/*
 * Internal core services shared by every layer: error details, logging, configuration, time and
 * small helpers. Nothing here knows about transports or jobs.
 */
#ifndef FR_CORE_H
#define FR_CORE_H

#include "ferry.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* ---- options structs: the one rule (ferry.h states it to callers) ----
 * Options structs only grow at their end, and `size` says how much of one the caller knows (a
 * binary built against an older ferry.h, or a binding that declares fewer fields). A public call
 * that takes one first checks it with FR_OPTS_CHECK, then reads every field through FR_OPT. */
/* A field of a caller's options struct, or `dflt` when the struct is NULL or its `size` does not
 * cover the field. */
#define FR_OPT(o, field, dflt)                                                                     \
  ((o) && (o)->size >= offsetof(__typeof__(*(o)), field) + sizeof((o)->field) ? (o)->field : (dflt))
/* 0 for NULL opts or a usable `size`. FERRY_EINVAL when `size` does not even cover itself (never
 * set) or exceeds FR_OPTS_MAX (garbage); FERRY_ENOTSUP when a byte beyond the `known` bytes this
 * library declares is not zero: the caller, built against a newer ferry.h, set a field this
 * library lacks, and ignoring it would do silently what it did not ask for. `what` names the
 * call in the detail. */
#define FR_OPTS_MAX 4096
int fr_opts_check(const void *opts, size_t known, const char *what);
#define FR_OPTS_CHECK(o, what) fr_opts_check((o), sizeof *(o), (what))

/* ---- errors ---- */
/* Sets the thread's detail message and returns `status`, so a failure reads
 *   return fr_err(FERRY_ERANGE, "read region %lu: offset %lu beyond %lu", ...); */
int fr_err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Same, appending ": strerror(errno)" and mapping errno to a status (ENOMEM, ENOSPC, ...). */
int fr_err_errno(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fr_err_clear(void);
/* fr_err() with the thread's current detail appended ("what: previous detail"): a caller adds
 * its own context to a failure it passes on. */
int fr_err_wrap(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A failure's status and detail, kept across cleanup that may set the detail again (a close, a
 * rollback): fr_err_restore puts the detail back as it was and returns the status, so an open
 * that fails reads
 *   fr_err_keep keep;
 *   fr_err_save(&keep, rc);
 *   ferry_x_close(x);
 *   return fr_err_restore(&keep);
 * keep.detail can also be read where the detail is reported rather than passed on. */
#define FR_ERR_DETAIL_MAX 512
typedef struct {
  int status;
  char detail[FR_ERR_DETAIL_MAX];
} fr_err_keep;
void fr_err_save(fr_err_keep *keep, int status);
int fr_err_restore(const fr_err_keep *keep);

/* ---- logging: the level check is one load, so disabled messages cost nothing ---- */
extern int fr_log_level_now;
/* Whether lines of `level` are written now: one relaxed load (a plain load on x86 and arm64,
 * and no data race with ferry_log_set_level from another thread). */
static inline bool fr_log_on(int level) {
  return level <= __atomic_load_n(&fr_log_level_now, __ATOMIC_RELAXED);
}
void fr_log_write(ferry_log_level level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define FR_LOG(level, ...)                                                                         \
  do {                                                                                             \
    if (fr_log_on((int)(level)))                                                                   \
      fr_log_write((level), __FILE__, __LINE__, __VA_ARGS__);                                      \
  } while (0)
#define fr_error(...) FR_LOG(FERRY_LOG_ERROR, __VA_ARGS__)
#define fr_warn(...) FR_LOG(FERRY_LOG_WARN, __VA_ARGS__)
#define fr_info(...) FR_LOG(FERRY_LOG_INFO, __VA_ARGS__)
#define fr_debug(...) FR_LOG(FERRY_LOG_DEBUG, __VA_ARGS__)
#define fr_trace(...) FR_LOG(FERRY_LOG_TRACE, __VA_ARGS__)
/* Lines about events that can repeat (a stalled subscriber, a refused put, a peer that keeps
 * failing): each call site lets FR_LOG_LIMIT_LINES through per FR_LOG_LIMIT_WINDOW_MS, holds the
 * rest back, and the next line it lets through says how many it held. */
#define FR_LOG_LIMIT_LINES 5
#define FR_LOG_LIMIT_WINDOW_MS 10000
typedef struct fr_log_limit {
  uint64_t window_ns; /* when the current window began (0: none yet) */
  uint32_t lines;     /* lines let through in it */
  uint64_t held;      /* lines held back since the last one let through */
} fr_log_limit;
/* Whether a line may go out at `now_ns` (fr_now_ns); *held: how many were held back before it. */
bool fr_log_limit_pass(fr_log_limit *l, uint64_t now_ns, uint64_t *held);
void fr_log_write_held(ferry_log_level level, const char *file, int line, uint64_t held,
                       const char *fmt, ...) __attribute__((format(printf, 5, 6)));
#define FR_LOG_LIMITED(level, ...)                                                                 \
  do {                                                                                             \
    static fr_log_limit fr_log_limit_;                                                             \
    uint64_t fr_log_held_;                                                                         \
    if (fr_log_on((int)(level)) && fr_log_limit_pass(&fr_log_limit_, fr_now_ns(), &fr_log_held_))  \
      fr_log_write_held((level), __FILE__, __LINE__, fr_log_held_, __VA_ARGS__);                   \
  } while (0)
#define fr_warn_limited(...) FR_LOG_LIMITED(FERRY_LOG_WARN, __VA_ARGS__)
#define fr_info_limited(...) FR_LOG_LIMITED(FERRY_LOG_INFO, __VA_ARGS__)
/* Parses "error|warn|info|debug|trace"; -1 when unknown. */
int fr_log_level_parse(const char *text);
/* Reads FERRY_LOG and FERRY_LOG_FORMAT (text|json; anything else warns once and means text).
 * Done when the library loads; tests call it again after changing the environment. */
void fr_log_configure(void);
/* Names this process's log lines after a node, when none is named yet: the first context to open
 * wins (a process normally holds one, and a name that stays put reads better than one that
 * follows whichever context opened last). True when it took the name; NULL clears it (its
 * context closed), so that the next context to open names the lines. Before any, they say "-". */
bool fr_log_set_node(const char *name);

/* ---- configuration (table in config.c) ---- */
int64_t fr_config_int(const char *name);
const char *fr_config_str(const char *name);
/* Whether the environment sets `name` (a command may pick another default than the library's:
 * `ferry serve` logs at info unless FERRY_LOG says otherwise). */
bool fr_config_is_set(const char *name);
/* A timeout argument resolved against FERRY_TIMEOUT_MS (negative → default). */
int fr_timeout(int timeout_ms);
/* Where this user's fleet secret lives: FERRY_TOKEN_FILE, else ~/.ferry/token. */
int fr_config_token_path(char *buf, size_t len);

/* ---- the per-user fleet secret (secret.c) ---- */
/* This user's secret (malloc'd, *out): read from fr_config_token_path, which is created (0600,
 * 32 random bytes in hex) when absent; refused when it is not a regular file this user owns
 * with no group or other permission bits. */
int fr_user_token(char **out);
/* FERRY_EINVAL unless `token` (named `what` in the error) is at least FR_TOKEN_MIN bytes; the
 * one line says how to make one. */
#define FR_TOKEN_MIN 16
int fr_token_check(const char *token, const char *what);

/* ---- files in directories other users may write (shared_file.c) ---- */
/* Opens `name` (relative to dfd, or AT_FDCWD) in a shared directory such as FERRY_CTL_DIR with
 * `flags` plus O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC, and keeps it only when fstat says it is a regular
 * file this user (euid) owns: 0 and *fd; FERRY_ENOTFOUND when there is none; FERRY_EACCES for a
 * symbolic link, a FIFO or another type, or another user's file, the error naming which. Never
 * blocks, never follows a link another user planted. */
int fr_open_shared(int dfd, const char *name, int flags, int *fd);

/* ---- time ---- */
uint64_t fr_now_ns(void); /* CLOCK_MONOTONIC */
/* A condition variable whose timed waits take CLOCK_MONOTONIC deadlines (fr_now_ns). */
void fr_cond_init_monotonic(pthread_cond_t *cond);
/* Nanoseconds (a CLOCK_MONOTONIC time, or a duration) as a timespec. */
static inline struct timespec fr_timespec(uint64_t ns) {
  return (struct timespec){(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
}
static inline uint64_t fr_deadline_ns(int timeout_ms) {
  return fr_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}
/* A spinning wait (spin.c): poll, then fr_spin_pause, until what it waits for is there or the
 * pause says the window is over. Between polls it pauses the CPU or yields the core (at every
 * pause by default; FERRY_SPIN_YIELD_NS=auto: first after twice what a yield costs, then at
 * growing gaps while nobody else wants it); yield_ns says how long the last pause's yield took
 * (0: it only paused), so a waiter can tell that another thread ran on its core. A waiter may
 * move `end` (a longer window). */
typedef struct fr_spin {
  uint64_t end;        /* fr_now_ns at which the window closes */
  uint64_t next_yield; /* when the next sched_yield is due */
  uint64_t gap;        /* between two yields */
  uint64_t yield_ns;   /* the last pause's yield, 0 if it did not yield */
} fr_spin;
void fr_spin_begin(fr_spin *s, uint64_t window_ns);
/* Pauses between two polls; false once the window is over (then it neither pauses nor yields:
 * the caller is done after its last poll). */
bool fr_spin_pause(fr_spin *s);
/* Milliseconds left until a deadline (0 when past), for poll(). */
int fr_ms_left(uint64_t deadline_ns);
/* Locks m, waiting no later than a CLOCK_MONOTONIC deadline; 0 or ETIMEDOUT. Through
 * pthread_mutex_timedlock (real time, converted here): TSan does not know
 * pthread_mutex_clocklock and takes a mutex locked by it for unlocked. */
int fr_mutex_lock_until(pthread_mutex_t *m, uint64_t deadline_ns);

/* ---- names (resolve.c) ---- */
struct addrinfo;
/* getaddrinfo(3) by a CLOCK_MONOTONIC deadline (0: none, as getaddrinfo alone). A numeric host
 * (or NULL) is resolved in place; a name on a thread of its own, which a caller that gave up
 * leaves to finish. Returns 0 (*out to freeaddrinfo), a getaddrinfo error (EAI_*), or
 * FR_RESOLVE_TIMEDOUT; fr_resolve_strerror says which in words. */
#define FR_RESOLVE_TIMEDOUT 1 /* EAI_* codes are negative */
int fr_resolve(const char *host, const char *service, const struct addrinfo *hints,
               uint64_t deadline_ns, struct addrinfo **out);
const char *fr_resolve_strerror(int rc);
/* Tests: the lookup a name goes through instead of getaddrinfo (NULL: getaddrinfo again). */
void fr_resolve_set_lookup(int (*fn)(const char *, const char *, const struct addrinfo *,
                                     struct addrinfo **));

/* ---- text ---- */
/* Copies the string src (NULL: "") into dst of cap bytes, cut to cap - 1 and always terminated
 * (when cap > 0); returns strlen(src), so a result >= cap means it was cut. snprintf(dst, cap,
 * "%s", src) without the format machinery, which cost ~400 instructions a copy (a put made
 * three: 13% of its instructions, callgrind). */
size_t fr_str_copy(char *dst, size_t cap, const char *src);
/* malloc for buffers that a caller frees with free(); large ones may get huge pages (util.c). */
void *fr_malloc_large(size_t n);
/* Length of the well-formed UTF-8 sequence at p (1..4 bytes, at most `left`), or 0 when p does
 * not start one (a stray continuation byte, an overlong form, a surrogate, beyond U+10FFFF). */
size_t fr_utf8_seq(const unsigned char *p, size_t left);

/* ---- names and escaping (name.c) ---- */
/* Length of the printable character at p (at most `left` bytes): well-formed UTF-8 that is not a
 * control character (C0, DEL, or C1: U+0080..U+009F); 0 when p is a control character or not
 * UTF-8. */
size_t fr_text_char(const unsigned char *p, size_t left);
/* The one rule for every name a peer or a caller gives (node, context, store, sender, topic and
 * cell names, and keys): 1 to `max` bytes of printable UTF-8 (fr_text_char). FERRY_EINVAL names
 * `what`, the name (escaped, as every detail is) and the first byte that breaks the rule. */
int fr_name_check(const char *what, const char *s, size_t max);
/* The same rule as a test, with no error detail set (decoders of what a peer sent). */
bool fr_name_ok(const char *s, size_t max);
/* Copies src (NULL: "") into dst of cap bytes with every byte that is not part of a printable
 * character (fr_text_char) written as \xNN, cut between whole characters and escapes, always
 * terminated (cap > 0). Returns the bytes written. Text for a log line, an error detail or a
 * terminal goes through it: no byte a peer chose can move a cursor or start a line. Idempotent:
 * its output holds no byte it would escape. 4 * strlen(src) + 1 bytes always suffice. */
size_t fr_escape(char *dst, size_t cap, const char *src);

/* ---- hashing for authentication (sha256.c) ---- */
void fr_sha256(const void *data, size_t len, uint8_t out[32]);
void fr_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                    uint8_t out[32]);
/* Compares in constant time (for MACs). */
bool fr_memeq_const(const void *a, const void *b, size_t len);

/* ---- growable arrays ---- */
/* Makes room for `need` elements of `elem` bytes in *items, whose capacity is *cap: when need
 * exceeds it, the capacity doubles (from `first` when it is 0) until it covers need and *items
 * is reallocated. On failure nothing changes and it returns FERRY_ENOMEM (also when the bytes
 * would overflow a size_t); it sets no error detail: the caller knows what grew. */
int fr_grow(void **items, size_t *cap, size_t need, size_t elem, size_t first);
/* The same for a typed array `arr` (an lvalue, T *) and its size_t capacity `cap`. */
#define FR_GROW(arr, cap, need, first)                                                             \
  __extension__({                                                                                  \
    void *fr_grow_p_ = (arr);                                                                      \
    int fr_grow_rc_ = fr_grow(&fr_grow_p_, &(cap), (need), sizeof *(arr), (first));                \
    (arr) = fr_grow_p_;                                                                            \
    fr_grow_rc_;                                                                                   \
  })

/* ---- misc ---- */
int fr_random_bytes(void *buf, size_t len);
uint64_t fr_random_u64(void);

/* ---- happens-before that ThreadSanitizer cannot see ----
 * Memory shared with a peer is mapped at another address even when the peer is in this process
 * (the tests run both ends side by side), and UCX synchronizes in code TSan does not see; so
 * code that hands data over such a channel releases a process-local object that stands for it,
 * and the code that takes the data acquires it. No code at all outside TSan builds. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer) && !defined(__SANITIZE_THREAD__)
#define __SANITIZE_THREAD__ 1 /* clang says so only through __has_feature */
#endif
#endif
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
#define FR_HB_RELEASE(obj) __tsan_release(obj)
#define FR_HB_ACQUIRE(obj) __tsan_acquire(obj)
/* A one-sided read of a region served to a peer (its bytes sent over a socket) may overlap the
 * owner rewriting them: by design, as when the peer reads the region over shm from another
 * process, where TSan cannot look. The reader verifies what it got (a refit bucket's checksum,
 * a store object's version), so the overlap costs a retry, never a wrong result; the send's
 * reads of the region are not the race TSan should report. */
#define FR_ONE_SIDED_READ_BEGIN() AnnotateIgnoreReadsBegin(__FILE__, __LINE__)
#define FR_ONE_SIDED_READ_END() AnnotateIgnoreReadsEnd(__FILE__, __LINE__)
/* TSan models no fences (gcc refuses them under -Werror=tsan): where a fence orders plain
 * accesses to shared memory against a flag, TSan builds keep only the compiler barrier. */
#define FR_FENCE(order) __atomic_signal_fence(order)
#else
#define FR_FENCE(order) __atomic_thread_fence(order)
#define FR_HB_RELEASE(obj) ((void)(obj))
#define FR_HB_ACQUIRE(obj) ((void)(obj))
#define FR_ONE_SIDED_READ_BEGIN() ((void)0)
#define FR_ONE_SIDED_READ_END() ((void)0)
#endif

#endif
