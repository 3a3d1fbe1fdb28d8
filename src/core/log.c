/*
 * Leveled logging to stderr or a user callback. The level is read once from FERRY_LOG; the macros
 * in core.h test it before formatting anything, so a disabled message costs one load.
 */
#include "core/core.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

int fr_log_level_now = FERRY_LOG_WARN;

static ferry_log_fn log_fn;
static void *log_arg;
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

__attribute__((constructor)) static void log_init_from_env(void) {
  int level = fr_log_level_parse(getenv("FERRY_LOG"));
  if (level >= 0)
    fr_log_level_now = level;
}

void ferry_log_set_level(ferry_log_level level) {
  if ((int)level >= FERRY_LOG_ERROR && level <= FERRY_LOG_TRACE)
    __atomic_store_n(&fr_log_level_now, (int)level, __ATOMIC_RELAXED);
}

ferry_log_level ferry_log_get_level(void) { return (ferry_log_level)fr_log_level_now; }

void ferry_log_set_callback(ferry_log_fn fn, void *arg) {
  pthread_mutex_lock(&log_lock);
  log_fn = fn;
  log_arg = arg;
  pthread_mutex_unlock(&log_lock);
}

void fr_log_write(ferry_log_level level, const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);

  pthread_mutex_lock(&log_lock);
  ferry_log_fn fn = log_fn;
  void *arg = log_arg;
  pthread_mutex_unlock(&log_lock);
  if (fn) {
    fn(level, msg, arg);
    return;
  }
  const char *base = strrchr(file, '/');
  fprintf(stderr, "ferry[%d] %s %s:%d: %s\n", (int)getpid(), level_names[level],
          base ? base + 1 : file, line, msg);
}
