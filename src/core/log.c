/*
 * Leveled logging to stderr or a user callback. The level is read once from FERRY_LOG; the macros
 * in core.h test it before formatting anything, so a disabled message costs one load.
 *
 * A stderr line says when (RFC 3339 UTC, microseconds), which process and which node (the name of
 * the first context opened in the process, "-" before one opens), as text or, with
 * FERRY_LOG_FORMAT=json, as one JSON object per line. The line is built in a buffer and written
 * with one write(2), so lines from threads (and processes sharing stderr) do not interleave. A
 * callback (ferry_log_set_callback; the Python binding's) gets the bare message: its logger adds
 * its own time and fields.
 *
 * A message often quotes what a peer sent (its node name, a key), so what is written is escaped:
 * the text format and the callback get every control byte (C0, DEL, C1) and every byte that is
 * not UTF-8 as \xNN (fr_escape), the JSON format as \u00XX. No peer can forge a line or send
 * escape sequences to the terminal that shows the log.
 *
 * Events that can repeat go through a per-call-site limit (fr_warn_limited, fr_info_limited):
 * a few lines per window, then a count of what was held back on the next line let through.
 */
#include "core/core.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

int fr_log_level_now = FERRY_LOG_WARN;

#define MSG_MAX 1024
#define NODE_MAX 64
/* Room for the longest line: every byte of a message and a node name escaped as \u00XX. */
#define SAFE_MAX (4 * MSG_MAX) /* a message with every byte escaped as \xNN */
#define LINE_MAX_BYTES (6 * (MSG_MAX + NODE_MAX) + 256)

static ferry_log_fn log_fn;
static void *log_arg;
static char log_node[NODE_MAX]; /* "" while no context names the process */
static bool log_json;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};

int fr_log_level_parse(const char *text) {
  if (!text)
    return -1;
  for (int i = 0; i < 5; i++)
    if (strcasecmp(text, level_names[i]) == 0)
      return i;
  return -1;
}

void fr_log_configure(void) {
  int level = fr_log_level_parse(ferry_config_get("FERRY_LOG"));
  if (level >= 0)
    __atomic_store_n(&fr_log_level_now, level, __ATOMIC_RELAXED);
  const char *format = fr_config_str("FERRY_LOG_FORMAT");
  bool json = strcasecmp(format, "json") == 0;
  __atomic_store_n(&log_json, json, __ATOMIC_RELAXED);
  static bool warned;
  if (!json && *format && strcasecmp(format, "text") != 0 &&
      !__atomic_exchange_n(&warned, true, __ATOMIC_RELAXED))
    fr_warn("FERRY_LOG_FORMAT=%s is neither text nor json; using text", format);
}

__attribute__((constructor)) static void log_init_from_env(void) { fr_log_configure(); }

void ferry_log_set_level(ferry_log_level level) {
  if ((int)level >= FERRY_LOG_ERROR && level <= FERRY_LOG_TRACE)
    __atomic_store_n(&fr_log_level_now, (int)level, __ATOMIC_RELAXED);
}

ferry_log_level ferry_log_get_level(void) {
  return (ferry_log_level)__atomic_load_n(&fr_log_level_now, __ATOMIC_RELAXED);
}

void ferry_log_set_callback(ferry_log_fn fn, void *arg) {
  pthread_mutex_lock(&log_lock);
  log_fn = fn;
  log_arg = arg;
  pthread_mutex_unlock(&log_lock);
}

bool fr_log_set_node(const char *name) {
  bool took = false;
  pthread_mutex_lock(&log_lock);
  if (!name) {
    log_node[0] = '\0';
    took = true;
  } else if (!log_node[0] && *name) {
    fr_str_copy(log_node, sizeof log_node, name);
    took = true;
  }
  pthread_mutex_unlock(&log_lock);
  return took;
}

/* ---- building a line ---- */

typedef struct line_buf {
  char data[LINE_MAX_BYTES];
  size_t len;
} line_buf;

/* Appends n bytes when they fit whole (keeping room for the line's end), else nothing. */
static void put(line_buf *b, const char *s, size_t n) {
  if (n <= sizeof b->data - 8 - b->len) {
    memcpy(b->data + b->len, s, n);
    b->len += n;
  }
}

static void puts_(line_buf *b, const char *s) { put(b, s, strlen(s)); }

static void putf(line_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(line_buf *b, const char *fmt, ...) {
  char tmp[128];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0)
    put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* 2026-12-01T14:03:05.123456Z */
static void put_time(line_buf *b) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char tmp[64];
  size_t n = strftime(tmp, sizeof tmp, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(tmp + n, sizeof tmp - n, ".%06ldZ", ts.tv_nsec / 1000);
  puts_(b, tmp);
}

/* s as a JSON string. A control character (C0, DEL, C1) becomes \u00XX, and so does a byte that
 * is not part of well-formed UTF-8 (the code point of the same value), so the line stays valid
 * JSON, no byte is lost and none of them reaches a terminal that shows the log raw. */
static void put_json_string(line_buf *b, const char *s) {
  const unsigned char *p = (const unsigned char *)s;
  size_t left = strlen(s);
  put(b, "\"", 1);
  while (left > 0) {
    size_t n = fr_text_char(p, left);
    const char *esc = NULL;
    switch (*p) {
    case '"':
      esc = "\\\"";
      break;
    case '\\':
      esc = "\\\\";
      break;
    case '\n':
      esc = "\\n";
      break;
    case '\r':
      esc = "\\r";
      break;
    case '\t':
      esc = "\\t";
      break;
    }
    if (esc) {
      puts_(b, esc);
      n = 1;
    } else if (n == 0) {
      n = fr_utf8_seq(p, left) == 2 ? 2 : 1; /* C1: C2 80..C2 9F is U+0080..U+009F */
      putf(b, "\\u%04x", n == 2 ? p[1] : *p);
    } else {
      put(b, (const char *)p, n);
    }
    p += n;
    left -= n;
  }
  put(b, "\"", 1);
}

static void format_text(line_buf *b, ferry_log_level level, const char *src, int line,
                        const char *node, const char *msg) {
  char safe_node[4 * NODE_MAX];
  fr_escape(safe_node, sizeof safe_node, *node ? node : "-");
  put_time(b);
  putf(b, " ferry[%d] node=", (int)getpid());
  puts_(b, safe_node);
  putf(b, " %s ", level_names[level]);
  putf(b, "%s:%d: ", src, line);
  /* the message may be longer than put's all-or-nothing allows at the end: cut it instead */
  size_t room = sizeof b->data - 8 - b->len, n = strlen(msg);
  put(b, msg, n < room ? n : room);
}

static void format_json(line_buf *b, ferry_log_level level, const char *src, int line,
                        const char *node, const char *msg) {
  puts_(b, "{\"ts\":\"");
  put_time(b);
  putf(b, "\",\"level\":\"%s\",\"pid\":%d,\"node\":", level_names[level], (int)getpid());
  put_json_string(b, *node ? node : "-");
  char where[512];
  snprintf(where, sizeof where, "%s:%d", src, line);
  puts_(b, ",\"src\":");
  put_json_string(b, where);
  puts_(b, ",\"msg\":");
  put_json_string(b, msg);
  put(b, "}", 1);
}

static void write_line(const line_buf *b) {
  size_t off = 0;
  while (off < b->len) {
    ssize_t n = write(STDERR_FILENO, b->data + off, b->len - off);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return; /* nowhere to report it */
    off += (size_t)n;
  }
}

/* Formats the message (with a note of the lines held back before it, when any) and writes it. */
static void log_vwrite(ferry_log_level level, const char *file, int line, uint64_t held,
                       const char *fmt, va_list ap) {
  char msg[MSG_MAX];
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  if (held > 0 && n >= 0 && (size_t)n < sizeof msg)
    snprintf(msg + n, sizeof msg - (size_t)n, " (%llu more like this held back)",
             (unsigned long long)held);

  char node[NODE_MAX];
  pthread_mutex_lock(&log_lock);
  ferry_log_fn fn = log_fn;
  void *arg = log_arg;
  memcpy(node, log_node, sizeof node);
  pthread_mutex_unlock(&log_lock);
  bool json = !fn && __atomic_load_n(&log_json, __ATOMIC_RELAXED);
  char safe[SAFE_MAX]; /* on the stack, as the line: logging "out of memory" needs no memory */
  if (!json)
    fr_escape(safe, sizeof safe, msg);
  if (fn) {
    fn(level, safe, arg);
    return;
  }
  const char *base = strrchr(file, '/');
  line_buf b;
  b.len = 0;
  if (json)
    format_json(&b, level, base ? base + 1 : file, line, node, msg);
  else
    format_text(&b, level, base ? base + 1 : file, line, node, safe);
  b.data[b.len++] = '\n';
  write_line(&b);
}

void fr_log_write(ferry_log_level level, const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vwrite(level, file, line, 0, fmt, ap);
  va_end(ap);
}

void fr_log_write_held(ferry_log_level level, const char *file, int line, uint64_t held,
                       const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vwrite(level, file, line, held, fmt, ap);
  va_end(ap);
}

/* ---- rate-limited lines ---- */

/* One lock for every call site's counts: they are touched only by lines about to be written. */
static pthread_mutex_t limit_lock = PTHREAD_MUTEX_INITIALIZER;

bool fr_log_limit_pass(fr_log_limit *l, uint64_t now_ns, uint64_t *held) {
  const uint64_t window = (uint64_t)FR_LOG_LIMIT_WINDOW_MS * 1000000ull;
  bool pass;
  pthread_mutex_lock(&limit_lock);
  if (l->window_ns == 0 || now_ns - l->window_ns >= window) {
    l->window_ns = now_ns ? now_ns : 1;
    l->lines = 0;
  }
  pass = l->lines < FR_LOG_LIMIT_LINES;
  *held = 0;
  if (pass) {
    l->lines++;
    *held = l->held;
    l->held = 0;
  } else {
    l->held++;
  }
  pthread_mutex_unlock(&limit_lock);
  return pass;
}
