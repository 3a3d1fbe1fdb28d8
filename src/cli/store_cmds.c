/*
 * The store commands: `ferry put`, `get`, `ls`, `rm` and `stat`. Each opens a short-lived node
 * (store_io.c) on the fleet's directory. A put reads the file straight into ferry memory and
 * hands it to a holder (`ferry serve`), which copies it out before the command exits; a get
 * reads from whichever node owns the key. Errors are one line on stderr; exit codes as in
 * `ferry --help`.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "cli/npy.h"
#include "cli/store_io.h"
#include "store/store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct args {
  const char *directory;
  char **pos; /* the operands */
  int npos;
  const char *dtype, *shape, *prefix;
  bool json, all;
} args;

/* The options of every store command: --directory and --json, then the command's own. */
#define STORE_OPTS(a)                                                                              \
  {"directory", CLI_ARG_STR, &(a)->directory, 0, 0}, { "json", CLI_ARG_FLAG, &(a)->json, 0, 0 }

/* Parses argv against the command; -1 on a usage error (message printed). */
static int parse(const cli_cmd *cmd, int argc, char **argv, args *a) {
  a->npos = cli_parse(cmd, argc, argv, &a->pos);
  return a->npos < 0 ? -1 : 0;
}

#define OPTIONS_HELP                                                                               \
  "\n  --directory URL  the fleet's directory: ferry://HOST:PORT, HOST:PORT or redis://...\n"      \
  "                   (default FERRY_DIRECTORY)\n"                                                 \
  "  --json           machine-readable output (JSON)\n"

/* dtype and shape as JSON members: "dtype":"uint8","shape":[2,3] */
static void json_desc(const ferry_tensor_desc *d) {
  printf("\"dtype\":");
  cli_json_string(stdout, ferry_dtype_name(d->dtype));
  printf(",\"shape\":[");
  for (uint32_t i = 0; i < d->ndim; i++)
    printf("%s%llu", i ? "," : "", (unsigned long long)d->shape[i]);
  printf("]");
}

/* One key as one JSON object on one line (ls --json, stat --json). */
static void json_info(const ferry_store_info *info) {
  printf("{\"key\":");
  cli_json_string(stdout, info->key);
  printf(",");
  json_desc(&info->desc);
  printf(",\"bytes\":%llu,\"owner\":", (unsigned long long)info->bytes);
  cli_json_string(stdout, info->owner);
  printf(",\"generation\":%llu}\n", (unsigned long long)info->generation);
}

static const char *fmt_bytes(uint64_t b, char *buf, size_t len) {
  if (b >= (1ull << 30))
    snprintf(buf, len, "%.1f GiB", (double)b / (1ull << 30));
  else if (b >= (1ull << 20))
    snprintf(buf, len, "%.1f MiB", (double)b / (1ull << 20));
  else if (b >= 1024)
    snprintf(buf, len, "%.1f KiB", (double)b / 1024);
  else
    snprintf(buf, len, "%llu B", (unsigned long long)b);
  return buf;
}

/* ---- put ---- */

static const char put_usage[] =
    "usage: ferry put KEY FILE [--dtype T --shape A,B,..] [--directory URL] [--json]\n\n"
    "Stores FILE's bytes under KEY. A .npy file (one that starts with \\x93NUMPY, whatever its\n"
    "name) brings its dtype and shape, which must account for exactly its data; otherwise\n"
    "they are --dtype (default uint8) and --shape (default: the whole file, one dimension).\n"
    "The bytes are held by a `ferry serve` node, so they outlive this command.\n"
    "On a terminal, files over 100 MB show a progress bar on stderr.\n" OPTIONS_HELP
    "                   (what was stored: {\"key\", \"dtype\", \"shape\", \"bytes\"})\n";

/* Reads the whole file into ferry memory (one read, no staging buffer): exactly the st_size
 * bytes fstat saw, so nothing past them is ever stored. Only regular files: a pipe or a device
 * has no size to reserve up front. */
static int read_file(cli_node *n, const char *path, void **out, uint64_t *len) {
  int fd = open(path, O_RDONLY);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) {
    fprintf(stderr, "ferry put: cannot open '%s': %s\n", path, strerror(errno));
    if (fd >= 0)
      close(fd);
    return CLI_NOTFOUND;
  }
  if (!S_ISREG(st.st_mode)) {
    fprintf(stderr, "ferry put: '%s' is not a regular file\n", path);
    close(fd);
    return CLI_USAGE;
  }
  void *mem = NULL;
  int rc = ferry_alloc(n->ctx, st.st_size ? (size_t)st.st_size : 1, &mem);
  if (rc != 0) {
    close(fd);
    return cli_fail("put", rc, "cannot reserve memory for the file");
  }
  cli_progress bar;
  cli_progress_start(&bar, "read", (uint64_t)st.st_size);
  uint64_t done = 0;
  ssize_t r = 1;
  int err = 0;
  while (done < (uint64_t)st.st_size && r != 0) {
    r = read(fd, (char *)mem + done, (size_t)st.st_size - done);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0) {
      err = errno;
      break;
    }
    done += (uint64_t)r;
    cli_progress_update(&bar, done, (uint64_t)st.st_size);
  }
  cli_progress_end(&bar);
  close(fd);
  if (done != (uint64_t)st.st_size) {
    fprintf(stderr, "ferry put: reading '%s' failed: %s\n", path,
            r < 0 ? strerror(err) : "the file shrank while being read");
    ferry_free(n->ctx, mem);
    return CLI_FAIL;
  }
  *out = mem;
  *len = done;
  return 0;
}

/* A .npy file (by its content: the \x93NUMPY magic, whatever its name) brings dtype and shape,
 * and they must describe exactly the bytes after its header. A broken .npy is a bad input file,
 * exit 1; a dtype ferry has no type for is a bad value, exit 2, as it is from --dtype (issue 35:
 * it was 1 from a header); --dtype/--shape with a .npy, or options that do not fit a raw file,
 * are a bad invocation, exit 2. */
static int describe_npy(const args *a, const char *path, const uint8_t *data, uint64_t len,
                        ferry_tensor_desc *d, size_t *skip) {
  if (a->dtype || a->shape) {
    fprintf(stderr,
            "ferry put: '%s' is a .npy file (starts with \\x93NUMPY): its header gives dtype "
            "and shape, so --dtype/--shape do not apply\n",
            path);
    return CLI_USAGE;
  }
  cli_npy npy;
  int rc = cli_npy_parse(data, (size_t)len, &npy);
  if (rc != 0) {
    fprintf(stderr, "ferry put: '%s': %s\n", path, ferry_last_error());
    return rc == FERRY_EDTYPE ? CLI_USAGE : CLI_FAIL;
  }
  *d = npy.desc;
  *skip = npy.data_offset;
  return 0;
}

/* Works out dtype and shape: from a .npy header, or the options, or "the whole file". On
 * success d describes exactly the len - *skip bytes after *skip. */
static int describe(const args *a, const char *path, const uint8_t *data, uint64_t len,
                    ferry_tensor_desc *d, size_t *skip) {
  *skip = 0;
  memset(d, 0, sizeof *d);
  if (cli_npy_magic(data, (size_t)len))
    return describe_npy(a, path, data, len, d, skip);
  d->dtype = FERRY_DTYPE_U8;
  if (a->dtype && ferry_dtype_parse(a->dtype, &d->dtype) != 0) {
    fprintf(stderr, "ferry put: unknown dtype '%s'\n", a->dtype);
    return CLI_USAGE;
  }
  size_t es = ferry_dtype_size(d->dtype);
  d->ndim = 1;
  d->shape[0] = len / es;
  if (a->shape && ferry_shape_parse(a->shape, d) != 0) {
    fprintf(stderr, "ferry put: bad shape '%s' (expected A,B,..)\n", a->shape);
    return CLI_USAGE;
  }
  uint64_t need = 0;
  if (ferry_tensor_nbytes(d, &need) != 0 || need != len) {
    char s[160];
    fprintf(stderr, "ferry put: %s %s is %llu bytes but the file has %llu\n",
            ferry_dtype_name(d->dtype), ferry_shape_format(d, s, sizeof s),
            (unsigned long long)need, (unsigned long long)len);
    return CLI_USAGE;
  }
  return 0;
}

int cli_put(int argc, char **argv) {
  args a = {0};
  const cli_opt opts[] = {STORE_OPTS(&a),
                          {"dtype", CLI_ARG_STR, &a.dtype, 0, 0},
                          {"shape", CLI_ARG_STR, &a.shape, 0, 0},
                          {0}};
  const cli_cmd cmd = {"put", put_usage, "KEY FILE", 2, 2, opts};
  if (parse(&cmd, argc, argv, &a) != 0)
    return CLI_USAGE;
  if (access(a.pos[1], R_OK) != 0) { /* say so before reaching for the fleet */
    fprintf(stderr, "ferry put: cannot open '%s': %s\n", a.pos[1], strerror(errno));
    return CLI_NOTFOUND;
  }
  cli_node n;
  int rc = cli_node_open(&n, a.directory, "put");
  if (rc != 0)
    return rc;
  void *mem = NULL;
  uint64_t len = 0;
  size_t skip = 0;
  ferry_tensor_desc d;
  if ((rc = read_file(&n, a.pos[1], &mem, &len)) == 0 &&
      (rc = describe(&a, a.pos[1], mem, len, &d, &skip)) == 0) {
    int st = ferry_store_put(n.store, a.pos[0], &d, (uint8_t *)mem + skip, 0, -1);
    rc = st ? cli_fail("put", st, a.pos[0]) : 0;
  }
  if (rc == 0 && a.json) {
    printf("{\"key\":");
    cli_json_string(stdout, a.pos[0]);
    printf(",");
    json_desc(&d);
    printf(",\"bytes\":%llu}\n", (unsigned long long)(len - skip));
  }
  ferry_free(n.ctx, mem);
  cli_node_close(&n);
  return rc;
}

/* ---- get ---- */

static const char get_usage[] =
    "usage: ferry get KEY [FILE|-] [--directory URL] [--json]\n\n"
    "Writes KEY's bytes to FILE (a .npy FILE gets a header with dtype and shape), or to\n"
    "stdout with '-' or no FILE (not to a terminal).\n"
    "On a terminal, transfers over 100 MB show a progress bar on stderr.\n" OPTIONS_HELP
    "                   (with a FILE only: {\"key\", \"file\", \"dtype\", \"shape\", \"bytes\",\n"
    "                   \"owner\", \"generation\"} on stdout once the file is written)\n";

/* The .npy header, when FILE is named *.npy, is made before FILE is created, so a dtype .npy
 * has no name for leaves no file behind; asking for one is a bad value (the FILE's name), exit
 * 2, as an unsupported dtype is for put. */
static int write_out(const char *path, const ferry_store_info *info, const void *data) {
  bool to_stdout = !path || strcmp(path, "-") == 0;
  uint8_t header[512];
  size_t hlen = 0;
  int rc = 0;
  if (!to_stdout && cli_has_suffix(path, ".npy") &&
      (rc = cli_npy_header(&info->desc, header, sizeof header, &hlen)) != 0) {
    fprintf(stderr, "ferry get: cannot write '%s': %s\n", path, ferry_last_error());
    return rc == FERRY_EDTYPE ? CLI_USAGE : CLI_FAIL;
  }
  FILE *f = to_stdout ? stdout : fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "ferry get: cannot create '%s': %s\n", path, strerror(errno));
    return CLI_FAIL;
  }
  bool ok = fwrite(header, 1, hlen, f) == hlen;
  if (ok && info->bytes && fwrite(data, 1, (size_t)info->bytes, f) != info->bytes)
    ok = false;
  if ((to_stdout ? fflush(f) : fclose(f)) != 0)
    ok = false;
  if (!ok)
    fprintf(stderr, "ferry get: writing %s failed: %s\n", to_stdout ? "stdout" : path,
            strerror(errno));
  return ok ? CLI_OK : CLI_FAIL;
}

int cli_get(int argc, char **argv) {
  args a = {0};
  const cli_opt opts[] = {STORE_OPTS(&a), {0}};
  const cli_cmd cmd = {"get", get_usage, "KEY", 1, 2, opts};
  if (parse(&cmd, argc, argv, &a) != 0)
    return CLI_USAGE;
  const char *path = a.npos > 1 ? a.pos[1] : NULL;
  bool to_stdout = !path || strcmp(path, "-") == 0;
  if (to_stdout && a.json)
    return cli_usage_error(&cmd, "--json needs a FILE: stdout carries the data");
  if (to_stdout && isatty(STDOUT_FILENO)) {
    fprintf(stderr, "ferry get: refusing to write binary data to a terminal; give a FILE or "
                    "redirect stdout\n");
    return CLI_USAGE;
  }
  cli_node n;
  int rc = cli_node_open(&n, a.directory, "get");
  if (rc != 0)
    return rc;
  ferry_store_info info = {.size = sizeof info};
  int st = ferry_store_stat(n.store, a.pos[0], &info, -1);
  void *data = NULL;
  if (st == 0) {
    cli_progress bar;
    cli_progress_start(&bar, "get", info.bytes);
    st = fr_store_get_progress(n.store, a.pos[0], &data, &info, cli_progress_update, &bar, -1);
    cli_progress_end(&bar);
  }
  rc = st ? cli_fail("get", st, a.pos[0]) : write_out(path, &info, data);
  if (rc == CLI_OK && a.json) {
    printf("{\"key\":");
    cli_json_string(stdout, info.key);
    printf(",\"file\":");
    cli_json_string(stdout, path);
    printf(",");
    json_desc(&info.desc);
    printf(",\"bytes\":%llu,\"owner\":", (unsigned long long)info.bytes);
    cli_json_string(stdout, info.owner);
    printf(",\"generation\":%llu}\n", (unsigned long long)info.generation);
  }
  free(data);
  cli_node_close(&n);
  return rc;
}

/* ---- ls, stat, rm ---- */

static const char ls_usage[] =
    "usage: ferry ls [PREFIX] [--directory URL] [--json]\n\n"
    "Lists the keys that start with PREFIX (all by default): key, dtype, shape, size, "
    "owner.\n" OPTIONS_HELP
    "                   (one object per key per line: {\"key\", \"dtype\", \"shape\",\n"
    "                   \"bytes\", \"owner\", \"generation\"}; no keys, no lines)\n";

int cli_ls(int argc, char **argv) {
  args a = {0};
  const cli_opt opts[] = {STORE_OPTS(&a), {0}};
  const cli_cmd cmd = {"ls", ls_usage, NULL, 0, 1, opts};
  if (parse(&cmd, argc, argv, &a) != 0)
    return CLI_USAGE;
  cli_node n;
  int rc = cli_node_open(&n, a.directory, "ls");
  if (rc != 0)
    return rc;
  ferry_store_info *list = NULL;
  size_t count = 0;
  int st = ferry_store_list(n.store, a.npos ? a.pos[0] : "", &list, &count, -1);
  if (st != 0)
    rc = cli_fail("ls", st, "list");
  for (size_t i = 0; st == 0 && i < count; i++) {
    char shape[160], size[32], key[4 * FR_DIR_KEY_MAX + 1], owner[4 * FR_DIR_NAME_MAX + 1];
    /* keys and owners come from peers (an older one, or Redis, may hold any bytes): escaped */
    fr_escape(key, sizeof key, list[i].key);
    fr_escape(owner, sizeof owner, list[i].owner);
    if (a.json)
      json_info(&list[i]);
    else
      printf("%-40s %-9s %-20s %10s  %s\n", key, ferry_dtype_name(list[i].desc.dtype),
             ferry_shape_format(&list[i].desc, shape, sizeof shape),
             fmt_bytes(list[i].bytes, size, sizeof size), owner);
  }
  ferry_store_list_free(list);
  cli_node_close(&n);
  return rc;
}

static const char stat_usage[] =
    "usage: ferry stat KEY [--directory URL] [--json]\n\n"
    "Describes KEY: dtype, shape, bytes, owner, generation.\n" OPTIONS_HELP
    "                   (one object: {\"key\", \"dtype\", \"shape\", \"bytes\", \"owner\",\n"
    "                   \"generation\"})\n";

int cli_stat(int argc, char **argv) {
  args a = {0};
  const cli_opt opts[] = {STORE_OPTS(&a), {0}};
  const cli_cmd cmd = {"stat", stat_usage, "KEY", 1, 1, opts};
  if (parse(&cmd, argc, argv, &a) != 0)
    return CLI_USAGE;
  cli_node n;
  int rc = cli_node_open(&n, a.directory, "stat");
  if (rc != 0)
    return rc;
  ferry_store_info info = {.size = sizeof info};
  int st = ferry_store_stat(n.store, a.pos[0], &info, -1);
  if (st != 0) {
    rc = cli_fail("stat", st, a.pos[0]);
  } else if (a.json) {
    json_info(&info);
  } else {
    char shape[160], key[4 * FR_DIR_KEY_MAX + 1], owner[4 * FR_DIR_NAME_MAX + 1];
    fr_escape(key, sizeof key, info.key); /* from peers: escaped, as in ls */
    fr_escape(owner, sizeof owner, info.owner);
    printf("key:        %s\ndtype:      %s\nshape:      %s\nbytes:      %llu\nowner:      %s\n"
           "generation: %llu\n",
           key, ferry_dtype_name(info.desc.dtype),
           ferry_shape_format(&info.desc, shape, sizeof shape), (unsigned long long)info.bytes,
           owner, (unsigned long long)info.generation);
  }
  cli_node_close(&n);
  return rc;
}

static const char rm_usage[] =
    "usage: ferry rm KEY [--directory URL]\n"
    "       ferry rm --prefix PREFIX [--directory URL]\n"
    "       ferry rm --all [--directory URL]\n\n"
    "Deletes KEY, or every key that starts with PREFIX, or with --all every key of the fleet,\n"
    "wherever it lives. An empty PREFIX would match every key, so it needs --all as well.\n"
    "\n  --directory URL  the fleet's directory (default FERRY_DIRECTORY)\n"
    "  --json           {\"deleted\": N} on stdout (for a KEY: 1)\n";

int cli_rm(int argc, char **argv) {
  args a = {0};
  const cli_opt opts[] = {STORE_OPTS(&a),
                          {"prefix", CLI_ARG_STR, &a.prefix, 0, 0},
                          {"all", CLI_ARG_FLAG, &a.all, 0, 0},
                          {0}};
  const cli_cmd cmd = {"rm", rm_usage, "KEY, --prefix PREFIX or --all", 0, 1, opts};
  if (parse(&cmd, argc, argv, &a) != 0)
    return CLI_USAGE;
  bool by_prefix = a.prefix || a.all;
  if (a.npos == 1 && by_prefix)
    return cli_usage_error(&cmd, "give KEY or --prefix/--all, not both");
  if (a.npos == 0 && !by_prefix)
    return cli_usage_error(&cmd, "missing KEY, --prefix PREFIX or --all");
  if (a.prefix && !*a.prefix && !a.all)
    return cli_usage_error(&cmd, "--prefix '' matches every key; add --all to delete them all");
  if (a.all && a.prefix && *a.prefix)
    return cli_usage_error(&cmd, "--all deletes every key; drop --prefix '%s' or --all", a.prefix);
  const char *prefix = a.all ? "" : a.prefix;
  cli_node n;
  int rc = cli_node_open(&n, a.directory, "rm");
  if (rc != 0)
    return rc;
  size_t deleted = 1;
  int st = by_prefix ? ferry_store_delete_prefix(n.store, prefix, &deleted, -1)
                     : ferry_store_delete(n.store, a.pos[0], -1);
  if (st != 0)
    rc = cli_fail("rm", st, by_prefix ? (*prefix ? prefix : "every key") : a.pos[0]);
  else if (a.json)
    printf("{\"deleted\":%zu}\n", deleted);
  else if (by_prefix)
    printf("deleted %zu\n", deleted);
  cli_node_close(&n);
  return rc;
}
