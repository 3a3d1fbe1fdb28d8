/*
 * Redis as deployed, for the tests (issue 36): a redis-server that speaks only TLS, with test
 * certificates that tests/redis/certs.sh makes with the openssl CLI, and a primary, a replica and
 * three sentinels on loopback (redis-server --sentinel). Each part is skipped with a message when
 * redis-server or openssl is missing. The servers die with the test (PR_SET_PDEATHSIG).
 */
#ifndef FERRY_REDISUTIL_H
#define FERRY_REDISUTIL_H

#include "directory/redis_conn.h"
#include "storeutil.h"

#include <string.h>

/* Starts redis-server with argv (NULL-terminated, argv[0] "redis-server"), its output thrown
 * away; waits until `port` accepts. 0 when it did not start. */
static inline pid_t su_spawn_redis(const char *const *argv, int port) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int devnull = open("/dev/null", O_WRONLY);
    dup2(devnull, 1);
    dup2(devnull, 2);
    execvp("redis-server", (char *const *)argv);
    _exit(127);
  }
  for (int i = 0; i < 1000; i++) {
    if (su_port_open(port))
      return pid;
    su_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return 0;
}

static inline void su_kill(pid_t *pid) {
  if (*pid > 0) {
    kill(*pid, SIGKILL);
    waitpid(*pid, NULL, 0);
    *pid = 0;
  }
}

static inline bool su_have_redis(void) {
  if (system("command -v redis-server >/dev/null 2>&1") == 0)
    return true;
  tu_skip(TU_SKIP_FIXABLE, "redis part: redis-server is not installed (scripts/deps.sh test)");
  return false;
}

/* A private scratch directory (removed by su_rmdir). */
static inline bool su_tempdir(char *dir, size_t cap) {
  snprintf(dir, cap, "/tmp/ferry-redis-XXXXXX");
  return mkdtemp(dir) != NULL;
}

static inline void su_rmdir(const char *dir) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0)
    fprintf(stderr, "could not remove %s\n", dir);
}

/* ---- TLS ---- */

typedef struct su_tls_redis {
  pid_t pid;
  int port;
  char dir[64]; /* ca.crt, other-ca.crt, server.*, client.* */
} su_tls_redis;

/* A redis-server with TLS only (--port 0) on a free port, bound to 127.0.0.1 and 127.0.0.2 (its
 * certificate names only the first), client certificates optional. */
static inline bool su_tls_redis_start(su_tls_redis *t) {
  memset(t, 0, sizeof *t);
  if (!su_have_redis())
    return false;
  if (system("command -v openssl >/dev/null 2>&1") != 0) {
    tu_skip(TU_SKIP_FIXABLE, "rediss part: openssl is not installed (scripts/deps.sh test)");
    return false;
  }
  char cmd[400];
  const char *src = getenv("FERRY_SOURCE_DIR");
  assert_true(su_tempdir(t->dir, sizeof t->dir));
  snprintf(cmd, sizeof cmd, "sh '%s/tests/redis/certs.sh' '%s'", src ? src : ".", t->dir);
  assert_int_equal(system(cmd), 0);
  char port[16], cert[128], key[128], ca[128];
  t->port = su_free_port();
  snprintf(port, sizeof port, "%d", t->port);
  snprintf(cert, sizeof cert, "%s/server.crt", t->dir);
  snprintf(key, sizeof key, "%s/server.key", t->dir);
  snprintf(ca, sizeof ca, "%s/ca.crt", t->dir);
  const char *argv[] = {"redis-server",
                        "--port",
                        "0",
                        "--tls-port",
                        port,
                        "--bind",
                        "127.0.0.1",
                        "127.0.0.2",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--tls-cert-file",
                        cert,
                        "--tls-key-file",
                        key,
                        "--tls-ca-cert-file",
                        ca,
                        "--tls-auth-clients",
                        "optional",
                        NULL};
  t->pid = su_spawn_redis(argv, t->port);
  if (!t->pid) {
    tu_skip(TU_SKIP_FIXABLE,
            "rediss part: redis-server did not start with TLS on port %d (built "
            "without TLS?)",
            t->port);
    su_rmdir(t->dir);
  }
  return t->pid != 0;
}

static inline void su_tls_redis_stop(su_tls_redis *t) {
  su_kill(&t->pid);
  su_rmdir(t->dir);
}

/* ---- Sentinel ---- */

typedef struct su_sentinels {
  pid_t primary, replica, sentinel[3];
  int primary_port, replica_port, sentinel_port[3];
  char dir[64];
  char url[160]; /* redis+sentinel://.../mymaster */
} su_sentinels;

/* One command to a loopback server; the reply (freeReplyObject), or NULL. */
static inline redisReply *su_redis_ask(int port, int argc, const char **argv) {
  fr_rconn *c = NULL;
  redisReply *rep = NULL;
  uint64_t deadline = fr_deadline_ns(10000); /* a hang detector: WAIT may take 5 s */
  if (fr_rconn_open("127.0.0.1", port, NULL, "test", deadline, 10000, &c) == 0 &&
      fr_rconn_call(c, argc, argv, NULL, &rep, deadline, 10000) != 0)
    rep = NULL;
  fr_rconn_close(c);
  return rep;
}

/* A field of SENTINEL master mymaster's reply (name, value, name, value...) as a number. */
static inline long su_sentinel_field(int port, const char *field) {
  const char *argv[3] = {"SENTINEL", "master", "mymaster"};
  redisReply *rep = su_redis_ask(port, 3, argv);
  long v = -1;
  for (size_t i = 0; rep && rep->type == REDIS_REPLY_ARRAY && i + 1 < rep->elements; i += 2)
    if (rep->element[i]->type == REDIS_REPLY_STRING && strcmp(rep->element[i]->str, field) == 0)
      v = atol(rep->element[i + 1]->str);
  if (rep)
    freeReplyObject(rep);
  return v;
}

static inline pid_t su_sentinel_spawn(su_sentinels *s, int i) {
  char conf[128];
  snprintf(conf, sizeof conf, "%s/sentinel%d.conf", s->dir, i);
  FILE *f = fopen(conf, "w");
  assert_non_null(f);
  fprintf(f,
          "port %d\nbind 127.0.0.1\ndir %s\n"
          "sentinel monitor mymaster 127.0.0.1 %d 2\n"
          "sentinel down-after-milliseconds mymaster 500\n"
          "sentinel failover-timeout mymaster 3000\n"
          "sentinel parallel-syncs mymaster 1\n",
          s->sentinel_port[i], s->dir, s->primary_port);
  fclose(f);
  const char *argv[] = {"redis-server", conf, "--sentinel", NULL};
  return su_spawn_redis(argv, s->sentinel_port[i]);
}

/* A primary, its replica (in sync) and three sentinels that know both and each other
 * (down-after-milliseconds 500, quorum 2). */
static inline bool su_sentinels_start(su_sentinels *s) {
  memset(s, 0, sizeof *s);
  if (!su_have_redis())
    return false;
  assert_true(su_tempdir(s->dir, sizeof s->dir));
  char p0[16], p1[16];
  s->primary_port = su_free_port();
  s->replica_port = su_free_port();
  snprintf(p0, sizeof p0, "%d", s->primary_port);
  snprintf(p1, sizeof p1, "%d", s->replica_port);
  const char *primary[] = {"redis-server", "--port", p0,      "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no",     "--dir", s->dir,   NULL};
  const char *replica[] = {
      "redis-server", "--port", p1,     "--bind",      "127.0.0.1", "--save", "",  "--appendonly",
      "no",           "--dir",  s->dir, "--replicaof", "127.0.0.1", p0,       NULL};
  s->primary = su_spawn_redis(primary, s->primary_port);
  s->replica = s->primary ? su_spawn_redis(replica, s->replica_port) : 0;
  for (int i = 0; i < 3 && s->replica; i++) {
    s->sentinel_port[i] = su_free_port();
    assert_true((s->sentinel[i] = su_sentinel_spawn(s, i)) != 0);
  }
  assert_true(s->replica != 0);
  snprintf(s->url, sizeof s->url,
           "redis+sentinel://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d/mymaster", s->sentinel_port[0],
           s->sentinel_port[1], s->sentinel_port[2]);
  /* sentinels find each other through the primary (hello messages every 2 s) */
  bool ready = false;
  for (int t = 0; t < 3000 && !ready; t++) {
    ready = true;
    for (int i = 0; i < 3 && ready; i++)
      ready = su_sentinel_field(s->sentinel_port[i], "num-other-sentinels") == 2 &&
              su_sentinel_field(s->sentinel_port[i], "num-slaves") == 1;
    if (!ready)
      su_sleep_ms(10);
  }
  assert_true(ready);
  return true;
}

static inline void su_sentinels_stop(su_sentinels *s) {
  for (int i = 0; i < 3; i++)
    su_kill(&s->sentinel[i]);
  su_kill(&s->replica);
  su_kill(&s->primary);
  su_rmdir(s->dir);
}

#endif
