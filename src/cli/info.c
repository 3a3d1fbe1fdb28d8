/*
 * `ferry info`: the library version, the transports this build has, the CUDA driver and its
 * devices, and with --config every FERRY_* setting with its current value and doc.
 */
#include "cli/args.h"
#include "cli/cli.h"
#include "transport/ucx.h"
#include "directory/directory.h"
#include "ferry.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char info_usage[] =
    "usage: ferry info [--config] [--json]\n\n"
    "Prints the version, the transports, the CUDA driver (FERRY_CUDA_LIB, else libcuda.so.1)\n"
    "and its devices, and whether the directory (FERRY_DIRECTORY) is up;\n"
    "--config lists every FERRY_* setting with its current value and what it does.\n"
    "--json prints one JSON object: {\"version\", \"transports\", \"ucx\", \"order\",\n"
    "\"cuda\": {\"found\", \"library\", \"driver_version\", \"devices\": [{\"name\",\n"
    "\"total_bytes\"}] or \"error\"},\n"
    "\"directory\": {\"url\", \"up\", \"nodes\" or \"error\"}, and with --config \"config\":\n"
    "[{\"name\", \"value\", \"default\", \"doc\"}]}.\n";

static void print_config(bool json) {
  for (size_t i = 0; i < ferry_config_count(); i++) {
    const ferry_config_item *it = ferry_config_at(i);
    char now[FR_DIR_ADDRESS_MAX + 1]; /* a URL's password never reaches the screen */
    fr_url_redact(ferry_config_get(it->name), now, sizeof now);
    if (strcmp(it->name, "FERRY_TOKEN") == 0 && *now)
      snprintf(now, sizeof now, "***");
    if (json) {
      printf("%s{\"name\":", i ? "," : "");
      cli_json_string(stdout, it->name);
      printf(",\"value\":");
      cli_json_string(stdout, now);
      printf(",\"default\":%s,\"doc\":", getenv(it->name) ? "false" : "true");
      cli_json_string(stdout, it->doc);
      printf("}");
    } else {
      printf("%-26s %-14s %s%s\n", it->name, *now ? now : "\"\"", it->doc,
             getenv(it->name) ? "" : " (default)");
    }
  }
}

/* The CUDA driver and its devices, as text or as the value of "cuda". */
static void print_cuda(bool json) {
  ferry_cuda_info ci = {.size = sizeof ci};
  ferry_cuda_info_get(&ci);
  if (json) {
    printf("{\"found\":%s,\"library\":", ci.found ? "true" : "false");
    cli_json_string(stdout, ci.library);
    if (!ci.found) {
      printf(",\"error\":");
      cli_json_string(stdout, ci.detail);
      printf("}");
      return;
    }
    printf(",\"driver_version\":%d,\"devices\":[", ci.driver_version);
  } else if (!ci.found) {
    printf("cuda:       no driver (%s)\n", ci.detail);
    return;
  } else {
    printf("cuda:       %s, driver %d.%d, %d device%s\n", ci.library, ci.driver_version / 1000,
           ci.driver_version % 1000 / 10, ci.devices, ci.devices == 1 ? "" : "s");
  }
  for (int d = 0; d < ci.devices; d++) {
    char name[256] = "?";
    uint64_t total = 0;
    ferry_cuda_device(d, name, sizeof name, &total);
    if (json) {
      printf("%s{\"name\":", d ? "," : "");
      cli_json_string(stdout, name);
      printf(",\"total_bytes\":%llu}", (unsigned long long)total);
    } else {
      printf("  cuda:%d     %s, %.1f GiB\n", d, name, (double)total / (1 << 30));
    }
  }
  if (json)
    printf("]}");
}

/* Whether the directory this node would use answers, and with how many nodes (-1: not). */
static long probe_directory(const char *url, char *error, size_t len) {
  ferry_ctx_opts co = {.size = sizeof co, .name = "ferry-info"};
  ferry_ctx *ctx = NULL;
  fr_dir *dir = NULL;
  int rc = ferry_ctx_open(&co, &ctx);
  if (rc == 0)
    rc = fr_dir_open(ctx, url, 1000, &dir);
  fr_dir_node *nodes = NULL;
  size_t n = 0;
  if (rc == 0)
    rc = fr_dir_node_list(dir, &nodes, &n, 1000);
  if (rc != 0)
    fr_str_copy(error, len, ferry_last_error());
  free(nodes);
  fr_dir_close(dir);
  ferry_ctx_close(ctx);
  return rc == 0 ? (long)n : -1;
}

static void print_json(bool config) {
  const char *url = ferry_config_get("FERRY_DIRECTORY");
  char error[512] = "", *ucx = NULL;
  size_t ucx_len = 0;
  FILE *mem = open_memstream(&ucx, &ucx_len);
  if (mem) {
    fr_ucx_describe(mem);
    fclose(mem);
  }
  printf("{\"version\":");
  cli_json_string(stdout, ferry_version());
  /* the text form's "ucx:        " label and final newline are not part of the value */
  const char *u = ucx ? ucx + strspn(ucx, "ucx: ") : "";
  if (ucx_len && ucx[ucx_len - 1] == '\n')
    ucx[ucx_len - 1] = '\0';
  printf(",\"transports\":[\"shm\",\"tcp\",\"ucx\"],\"ucx\":");
  cli_json_string(stdout, u);
  printf(",\"order\":");
  cli_json_string(stdout, ferry_config_get("FERRY_TRANSPORTS"));
  printf(",\"cuda\":");
  print_cuda(true);
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  printf(",\"directory\":{\"url\":");
  cli_json_string(stdout, shown);
  long nodes = probe_directory(url, error, sizeof error);
  if (nodes >= 0) {
    printf(",\"up\":true,\"nodes\":%ld}", nodes);
  } else {
    printf(",\"up\":false,\"error\":");
    cli_json_string(stdout, error);
    printf("}");
  }
  if (config) {
    printf(",\"config\":[");
    print_config(true);
    printf("]");
  }
  printf("}\n");
  free(ucx);
}

int cli_info(int argc, char **argv) {
  bool config = false, json = false;
  const cli_opt opts[] = {
      {"config", CLI_ARG_FLAG, &config, 0, 0}, {"json", CLI_ARG_FLAG, &json, 0, 0}, {0}};
  const cli_cmd cmd = {"info", info_usage, NULL, 0, 0, opts};
  if (cli_parse(&cmd, argc, argv, NULL) < 0)
    return CLI_USAGE;
  if (json) {
    print_json(config);
    return CLI_OK;
  }
  printf("ferry %s\n", ferry_version());
  printf("transports: shm (same host: unix socket + mapped memory), tcp, ucx\n");
  fr_ucx_describe(stdout);
  printf("order:      %s (FERRY_TRANSPORTS)\n", ferry_config_get("FERRY_TRANSPORTS"));
  print_cuda(false);
  const char *url = ferry_config_get("FERRY_DIRECTORY");
  char error[512] = "";
  long nodes = probe_directory(url, error, sizeof error);
  char shown[FR_DIR_ADDRESS_MAX + 1];
  fr_url_redact(url, shown, sizeof shown);
  printf("directory:  %s (FERRY_DIRECTORY): ", shown);
  if (nodes >= 0)
    printf("up, %ld node%s\n", nodes, nodes == 1 ? "" : "s");
  else
    printf("not reachable: %s\n", error);
  if (config)
    print_config(false);
  return CLI_OK;
}
