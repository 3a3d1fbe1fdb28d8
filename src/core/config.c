/*
 * The configuration table: every FERRY_* setting with its default and a one-line doc, in one
 * place. Values come from the environment when set; `ferry info --config` prints the table.
 * Jobs add their rows here rather than calling getenv() themselves.
 */
#include "core/core.h"

#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FR_CONFIG_TABLE(X)                                                                         \
  X("FERRY_LOG", "warn", "log level: error, warn, info, debug or trace")                           \
  X("FERRY_METRICS_LISTEN", "",                                                                    \
    "HOST:PORT where every ctx serves /metrics, /healthz, /readyz (empty: off; port 0: any free)") \
  X("FERRY_LOG_FORMAT", "text", "stderr log lines: text, or json (one object per line)")           \
  X("FERRY_BENCH_BIN", "",                                                                         \
    "`ferry bench`'s program (empty: ferry-bench beside ferry, or in ../libexec/ferry from it)")   \
  X("FERRY_CUDA", "auto", "auto: load the CUDA driver when a call needs it, if there is one; off") \
  X("FERRY_CUDA_LIB", "", "the CUDA driver library to load (empty: libcuda.so.1)")                 \
  X("FERRY_CUDA_CHUNK_BYTES", "4194304",                                                           \
    "CUDA bytes staged through host memory per chunk (two chunks in flight per stream)")           \
  X("FERRY_CUDA_PACK_ASYNC", "0",                                                                  \
    "refit senders (as of the seal): 1 queues a bucket's device tensor copies on one stream and "  \
    "waits once per bucket; 0 waits for each copy (not yet measured on a device which is faster)") \
  X("FERRY_CUDA_BOUNCE", "malloc",                                                                 \
    "a CUDA buffer read or written over a link without a device path: malloc (a fresh pageable "   \
    "buffer per call) or pinned (each thread's pinned staging pair, reused: 2 chunks pinned per "  \
    "thread for its life; not yet measured on a device which is faster)")                          \
  X("FERRY_TIMEOUT_MS", "10000", "default timeout of blocking calls (connect, read, send)")        \
  X("FERRY_TRANSPORTS", "shm,tcp", "transports a link may use, in order of preference")            \
  X("FERRY_TCP_LISTEN", "127.0.0.1:0", "HOST:PORT of the tcp listener (port 0: any free)")         \
  X("FERRY_UCX_LISTEN", "", "HOST:PORT of the ucx handshake listener (empty: tcp's host, port 0)") \
  X("FERRY_UCX_RMA", "auto", "ucx one-sided reads: get (RMA), am (owner answers) or auto")         \
  X("FERRY_TCP_SOCKBUF", "0", "tcp socket buffer bytes; 0 leaves them to the kernel (autotuning)") \
  X("FERRY_TCP_LOCAL_CC", "reno",                                                                  \
    "congestion control of tcp links within this host (empty: the kernel's default)")              \
  X("FERRY_TOKEN", "",                                                                             \
    "fleet token every link must prove it knows (empty: this user's secret, FERRY_TOKEN_FILE)")    \
  X("FERRY_TOKEN_FILE", "",                                                                        \
    "per-user secret used when FERRY_TOKEN is empty; made 0600 if absent (empty: ~/.ferry/token)") \
  X("FERRY_MAX_MESSAGE", "1073741824", "largest message or one-sided transfer accepted, bytes")    \
  X("FERRY_ALLOC_CACHE_BYTES", "268435456",                                                        \
    "bytes of freed ferry_alloc memory a process keeps to reuse, pages still mapped (0: none)")    \
  X("FERRY_SHM_RING_BYTES", "1048576",                                                             \
    "bytes of each direction's ring on a shm link (power of 2)")                                   \
  X("FERRY_REFIT_BUFFER_BYTES", "67108864", "refit bucket size in bytes (two are allocated)")      \
  X("FERRY_REFIT_BUFFER_RATIO", "", "if set (0..1): refit buckets take this share of free memory") \
  X("FERRY_REFIT_DEVICE_WHOLE", "0",                                                               \
    "experiment: 1: a device-bucket refit sender packs into one CUDA buffer of the whole version " \
    "(a slot per bucket) instead of two slots")                                                    \
  X("FERRY_REFIT_NO_OVERLAP", "0",                                                                 \
    "experiment: 1: a refit sender packs a bucket only once its receivers read the one before")    \
  X("FERRY_SPIN_US", "200", "microseconds a waiter spins before it sleeps (latency vs. CPU)")      \
  X("FERRY_SPIN_YIELD_NS", "0",                                                                    \
    "a spinner's first gap between yields of its core (0: none, a yield per poll; auto: "          \
    "adaptive)")                                                                                   \
  X("FERRY_LEAD_FOLLOW_US", "1000",                                                                \
    "how long a waiting caller waits for a service thread to hand it the ctx's epoll")             \
  X("FERRY_SLEEPER_SLICE_MS", "100",                                                               \
    "longest sleep of a caller waiting on another thread's epoll before it looks again")           \
  X("FERRY_SHARED_CORE_US", "20",                                                                  \
    "a yield taking longer ran another thread on this core: a polling waiter then sleeps")         \
  X("FERRY_MSG_KEEP_IDLE_MS", "2000",                                                              \
    "received-message buffers of a size unused this long go back to the system")                   \
  X("FERRY_HTTP_HEADER_MS", "5000",                                                                \
    "an HTTP client (metrics, status page, ctl serve) that has not sent a whole request in this "  \
    "long is closed")                                                                              \
  X("FERRY_FLEET_BUDGET_MS", "3000",                                                               \
    "how long one fleet snapshot (/v1/fleet, ferry top) may take, nodes asked in parallel")        \
  X("FERRY_CTL_DIR", "/dev/shm", "directory of control cells (ferry-ctl-NAME files)")              \
  X("FERRY_CTL_CHECK_MS", "100", "how often a waiting controller checks that ranks are alive")     \
  X("FERRY_CTL_SPIN_US", "1000",                                                                   \
    "microseconds a control request yields for its acks before it sleeps")                         \
  X("FERRY_DIRECTORY", "ferry://127.0.0.1:7700",                                                   \
    "directory URL: ferry://HOST:PORT (embedded; `ferry serve`), "                                 \
    "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS), "                             \
    "redis+sentinel://S1[:PORT],S2[:PORT],.../NAME[/DB] or "                                       \
    "etcd://HOST[:PORT][,HOST[:PORT]...] (an etcd cluster)")                                       \
  X("FERRY_REDIS_TLS_CA", "",                                                                      \
    "rediss://: CA certificates (PEM file) the server's certificate must chain to, where the URL " \
    "has no ?ca= (empty: the system's store)")                                                     \
  X("FERRY_REDIS_TLS_CERT", "",                                                                    \
    "rediss://: client certificate (PEM) for mutual TLS, where the URL has no ?cert= (empty: "     \
    "none)")                                                                                       \
  X("FERRY_REDIS_TLS_KEY", "", "rediss://: the client certificate's key (PEM), where no ?key=")    \
  X("FERRY_P2P_FLEET", "p2pstore",                                                                 \
    "ferry.p2pstore's scope: keys live as FLEET/key, clear() removes this fleet's only")           \
  X("FERRY_LEASE_MS", "15000",                                                                     \
    "a node's directory lease; its records vanish this long after it dies")                        \
  X("FERRY_STORE_CAPACITY", "1073741824", "bytes of a node's store pool (copied puts live there)") \
  X("FERRY_STORE_MAX_OBJECTS", "65536", "most objects one node's store holds at once")             \
  X("FERRY_STORE_LINGER_MS", "1000",                                                               \
    "a replaced store copy stays at least this long for gets under way (less if room is needed)")  \
  X("FERRY_STORE_DEVICE_POOL_BYTES", "0",                                                          \
    "bytes of a node's device pool: puts from CUDA memory stay there, gets copy device to device " \
    "(0: off, they go through the host pool)")                                                     \
  X("FERRY_STORE_THREADS", "4", "threads a batch get uses to keep reads in flight")                \
  X("FERRY_TASK_THREADS", "64",                                                                    \
    "most threads of the process's task pool (store gets and uploads, lease renewals, askers)")    \
  X("FERRY_MQ_QUEUE_BYTES", "67108864",                                                            \
    "mq: bytes of messages a subscriber queues per publisher before publishes wait")               \
  X("FERRY_MQ_INLINE_BYTES", "65536",                                                              \
    "mq: larger payloads to a subscriber on this host go through the shared-memory pool")          \
  X("FERRY_MQ_STALL_LOG_MS", "1000",                                                               \
    "mq: a publish that waits this long for a subscriber's queue to have room logs who held it")   \
  X("FERRY_MQ_POOL_BYTES", "268435456",                                                            \
    "mq: bytes of a publisher's shared-memory pool for large payloads (made on first use)")        \
  X("FERRY_MQ_FLUSH_US", "50", "mq: a batch of small messages goes out after this at the latest")  \
  X("FERRY_MQ_STREAM_GAP_US", "20",                                                                \
    "mq: publishes closer than this are a stream, batched per subscriber")                         \
  X("FERRY_MQ_WARM_WAIT_US", "2000",                                                               \
    "mq: least a large publish waits for a pool block in use to come back before it grows the "    \
    "pool")

static const ferry_config_item config_table[] = {
#define FR_CONFIG_ROW_(name, def, doc) {name, def, doc},
    FR_CONFIG_TABLE(FR_CONFIG_ROW_)
#undef FR_CONFIG_ROW_
};
#define CONFIG_COUNT (sizeof config_table / sizeof config_table[0])

size_t ferry_config_count(void) { return CONFIG_COUNT; }

const ferry_config_item *ferry_config_at(size_t i) {
  return i < CONFIG_COUNT ? &config_table[i] : NULL;
}

const char *ferry_config_get(const char *name) {
  if (!name)
    return NULL;
  for (size_t i = 0; i < CONFIG_COUNT; i++) {
    if (strcmp(config_table[i].name, name) == 0) {
      const char *env = getenv(name);
      return env ? env : config_table[i].default_value;
    }
  }
  return NULL;
}

bool fr_config_is_set(const char *name) {
  for (size_t i = 0; name && i < CONFIG_COUNT; i++)
    if (strcmp(config_table[i].name, name) == 0)
      return getenv(name) != NULL;
  return false;
}

const char *fr_config_str(const char *name) {
  const char *v = ferry_config_get(name);
  return v ? v : "";
}

int64_t fr_config_int(const char *name) {
  const char *text = ferry_config_get(name);
  char *end = NULL;
  errno = 0;
  long long v = text ? strtoll(text, &end, 0) : 0;
  if (!text || errno || end == text || *end) {
    /* A malformed value falls back to the default, loudly. */
    for (size_t i = 0; i < CONFIG_COUNT; i++)
      if (strcmp(config_table[i].name, name) == 0) {
        fr_warn("%s=%s is not a number; using %s", name, text ? text : "(null)",
                config_table[i].default_value);
        return strtoll(config_table[i].default_value, NULL, 0);
      }
    return 0;
  }
  return v;
}

/* FERRY_TIMEOUT_MS as it is now, read at every call that takes the default (a put, a get): the
 * parse (a scan of the settings table and strtoll) is redone, per thread, only when the
 * environment holds another string for it (setenv stores a new one for a new value; a putenv
 * buffer rewritten in place is not seen). */
int fr_timeout(int timeout_ms) {
  static __thread const char *seen;
  static __thread int parsed;
  static __thread bool known;
  if (timeout_ms >= 0)
    return timeout_ms;
  const char *env = getenv("FERRY_TIMEOUT_MS");
  if (known && env == seen)
    return parsed;
  int64_t v = fr_config_int("FERRY_TIMEOUT_MS");
  parsed = v < 0 ? 0 : v > 86400000 ? 86400000 : (int)v;
  seen = env;
  known = true;
  return parsed;
}

/* The home directory comes from the password database first: it is the same for every process of
 * the user whatever its environment (sudo, cron and service managers set HOME differently, and
 * two processes that resolved different files would not talk). $HOME is the fallback for a uid
 * with no entry (containers run under arbitrary uids). $XDG_RUNTIME_DIR is not used: it exists
 * only while the user has a login session and is emptied at logout, under a node that lives on. */
int fr_config_token_path(char *buf, size_t len) {
  const char *file = fr_config_str("FERRY_TOKEN_FILE");
  if (*file) {
    if (fr_str_copy(buf, len, file) >= len)
      return fr_err(FERRY_EINVAL, "FERRY_TOKEN_FILE is longer than %zu bytes", len - 1);
    return 0;
  }
  char pwbuf[4096];
  struct passwd pw, *found = NULL;
  const char *home = NULL;
  if (getpwuid_r(geteuid(), &pw, pwbuf, sizeof pwbuf, &found) == 0 && found && found->pw_dir &&
      found->pw_dir[0] == '/')
    home = found->pw_dir;
  if (!home) {
    const char *env = getenv("HOME");
    home = env && env[0] == '/' ? env : NULL;
  }
  if (!home)
    return fr_err(FERRY_EINVAL,
                  "no home directory for uid %u to keep the fleet token in: set "
                  "FERRY_TOKEN, or FERRY_TOKEN_FILE to a file this user owns",
                  (unsigned)geteuid());
  if ((size_t)snprintf(buf, len, "%s%s.ferry/token", home,
                       home[strlen(home) - 1] == '/' ? "" : "/") >= len)
    return fr_err(FERRY_EINVAL, "home directory '%s' is too long", home);
  return 0;
}
