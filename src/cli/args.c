/*
 * The argument parser every `ferry` subcommand uses (args.h): a subcommand's option table becomes
 * getopt_long's, each value is checked as it is read, and every mistake is one line on stderr
 * that names the option or argument and where the help is. One parser means one behaviour:
 * `--opt=value` works wherever `--opt value` does, every size takes the same suffixes, and no
 * subcommand ignores an argument it does not understand.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "core/core.h"
#include "ferry.h"

#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_OPTS 32
#define FIRST_OPT 256 /* getopt_long's value for table row i is FIRST_OPT + i */
#define VERSION_OPT (FIRST_OPT + MAX_OPTS)

int cli_usage_error(const cli_cmd *cmd, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "ferry %s: %s (ferry %s --help)\n", cmd->name, msg, cmd->name);
  return CLI_USAGE;
}

void cli_help(const cli_cmd *cmd, FILE *out) {
  fputs(cmd->usage, out);
  fputc('\n', out);
  cli_print_exit_codes(out);
}

/* ---- values ---- */

int cli_parse_size(const char *text, uint64_t *bytes) {
  static const struct {
    const char *name;
    uint64_t mult;
  } units[] = {{"", 1},           {"b", 1},
               {"k", 1ull << 10}, {"kib", 1ull << 10},
               {"m", 1ull << 20}, {"mib", 1ull << 20},
               {"g", 1ull << 30}, {"gib", 1ull << 30},
               {"t", 1ull << 40}, {"tib", 1ull << 40}};
  const char *p = text;
  uint64_t whole = 0, frac = 0, scale = 1;
  if (!p || *p < '0' || *p > '9')
    return -1; /* no sign, no space, no empty string */
  for (; *p >= '0' && *p <= '9'; p++)
    if (__builtin_mul_overflow(whole, 10, &whole) ||
        __builtin_add_overflow(whole, *p - '0', &whole))
      return -1;
  if (*p == '.') {
    if (*++p < '0' || *p > '9')
      return -1;
    for (; *p >= '0' && *p <= '9'; p++)
      if (scale < 1000000000000000000ull) /* digits past 18 cannot change a whole byte */
        frac = frac * 10 + (uint64_t)(*p - '0'), scale *= 10;
  }
  for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
    if (strcasecmp(p, units[i].name) != 0)
      continue;
    uint64_t v, part = (uint64_t)((unsigned __int128)frac * units[i].mult / scale);
    if (frac && units[i].mult == 1)
      return -1; /* a fraction of a byte */
    if (__builtin_mul_overflow(whole, units[i].mult, &v) || __builtin_add_overflow(v, part, &v))
      return -1;
    *bytes = v;
    return 0;
  }
  return -1;
}

int cli_parse_seconds(const char *text) {
  char *end = NULL;
  double s = text ? strtod(text, &end) : -1;
  if (!text || end == text || *end || !(s >= 0) || s > 86400)
    return -1;
  return (int)llround(s * 1000.0);
}

static int set_value(const cli_cmd *cmd, const cli_opt *o, const char *v) {
  uint64_t n = 0;
  char *end = NULL;
  switch (o->kind) {
  case CLI_ARG_FLAG:
    *(bool *)o->target = true;
    return 0;
  case CLI_ARG_STR:
    *(const char **)o->target = v;
    return 0;
  case CLI_ARG_SECONDS: {
    int ms = cli_parse_seconds(v);
    if (ms < 0)
      return cli_usage_error(cmd, "--%s wants seconds (e.g. 30, 0.5), not '%s'", o->name, v), -1;
    *(int *)o->target = ms;
    return 0;
  }
  case CLI_ARG_SIZE:
    if (cli_parse_size(v, &n) != 0)
      return cli_usage_error(cmd, "--%s wants a size such as 4096, 64K, 1M or 2GiB, not '%s'",
                             o->name, v),
             -1;
    break;
  case CLI_ARG_INT:
    n = v[0] >= '0' && v[0] <= '9' ? strtoull(v, &end, 10) : 0;
    if (!end || *end || n > INT_MAX)
      return cli_usage_error(cmd, "--%s wants a whole number, not '%s'", o->name, v), -1;
    break;
  }
  if (n < o->min || (o->max && n > o->max)) {
    if (o->max)
      return cli_usage_error(cmd, "--%s %s is out of range (%llu..%llu)", o->name, v,
                             (unsigned long long)o->min, (unsigned long long)o->max),
             -1;
    return cli_usage_error(cmd, "--%s %s is too small (at least %llu)", o->name, v,
                           (unsigned long long)o->min),
           -1;
  }
  if (o->kind == CLI_ARG_SIZE)
    *(uint64_t *)o->target = n;
  else
    *(int *)o->target = (int)n;
  return 0;
}

/* ---- options ---- */

/* The message for getopt_long's '?': which option it did not take, and why. */
static int bad_option(const cli_cmd *cmd, char **argv, const struct option *lo, size_t nlo) {
  if (optopt == 'h' || optopt >= FIRST_OPT) {
    for (size_t i = 0; i < nlo; i++)
      if (lo[i].val == optopt)
        return cli_usage_error(cmd, "option '--%s' takes no value", lo[i].name);
  }
  if (optopt)
    return cli_usage_error(cmd, "unknown option '-%c'", optopt);
  char text[128];
  fr_str_copy(text, sizeof text, argv[optind - 1]);
  text[strcspn(text, "=")] = '\0';
  size_t matches = 0;
  for (size_t i = 0; i < nlo; i++)
    matches += strncmp(lo[i].name, text + 2, strlen(text + 2)) == 0;
  return cli_usage_error(cmd, "%s option '%s'", matches > 1 ? "ambiguous" : "unknown", text);
}

int cli_parse(const cli_cmd *cmd, int argc, char **argv, char ***operands) {
  struct option lo[MAX_OPTS + 3];
  size_t n = 0;
  for (const cli_opt *o = cmd->opts; o && o->name && n < MAX_OPTS; o++, n++)
    lo[n] = (struct option){o->name, o->kind == CLI_ARG_FLAG ? no_argument : required_argument,
                            NULL, FIRST_OPT + (int)n};
  lo[n++] = (struct option){"help", no_argument, NULL, 'h'};
  lo[n++] = (struct option){"version", no_argument, NULL, VERSION_OPT};
  lo[n] = (struct option){0};
  optind = 0; /* GNU: start over (bench all parses once per mode) */
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, ":h", lo, NULL)) != -1) {
    if (c == 'h' || c == VERSION_OPT) {
      if (c == 'h')
        cli_help(cmd, stdout);
      else
        printf("ferry %s\n", ferry_version());
      fflush(stdout);
      exit(CLI_OK);
    }
    if (c == '?')
      return bad_option(cmd, argv, lo, n), -1;
    if (c == ':')
      return cli_usage_error(cmd, "option '%s' needs a value", argv[optind - 1]), -1;
    if (c < FIRST_OPT || set_value(cmd, &cmd->opts[c - FIRST_OPT], optarg) != 0)
      return -1;
  }
  int count = argc - optind;
  if (count > cmd->max_operands)
    return cli_usage_error(cmd, "unexpected argument '%s'", argv[optind + cmd->max_operands]), -1;
  if (count < cmd->min_operands)
    return cli_usage_error(cmd, "missing %s", cmd->operands ? cmd->operands : "arguments"), -1;
  if (operands)
    *operands = argv + optind;
  return count;
}

/* ---- JSON ---- */

void cli_json_string(FILE *out, const char *s) {
  fputc('"', out);
  const unsigned char *p = (const unsigned char *)(s ? s : "");
  for (size_t left = strlen((const char *)p); *p;) {
    size_t n = fr_text_char(p, left), u = n ? n : fr_utf8_seq(p, left);
    if (*p == '"' || *p == '\\')
      fprintf(out, "\\%c", *p);
    else if (n == 0 && u == 0)
      fputs("\\ufffd", out);
    else if (n == 0) /* a control character: C0, DEL, or C1 (C2 80..C2 9F is U+0080..U+009F) */
      fprintf(out, "\\u%04x", u == 2 ? p[1] : *p), n = u;
    else
      fwrite(p, 1, n, out);
    p += n ? n : 1;
    left -= n ? n : 1;
  }
  fputc('"', out);
}
