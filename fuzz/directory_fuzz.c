/*
 * libFuzzer target for the embedded directory's protocol: each input is a sequence of request
 * messages (u16 length, then bytes) handled by one server state, as a client would send them.
 * Every reply must decode as a well-formed reply; the input is also fed to the record and reply
 * decoders directly, and laid over a slot of the shared object table (table.h: memory any
 * same-host process can write) for its reader, and every decoded object's key to the job record
 * parser (lease.c: a peer's "ferry:job/KIND/NAME" is untrusted). Nothing may crash, leak or read
 * out of bounds.
 */
#include "directory/dirwire.h"
#include "directory/table.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void check_reply(const void *p, size_t len) {
  fr_rd r = fr_rd_init(p, len);
  int st = 0;
  char detail[1024];
  assert(fr_rd_reply(&r, &st, detail, sizeof detail));
  assert(st <= 0);
}

/* A key taken apart as a job record: when it is one, both parts are bounded, non-empty strings
 * that spell the key again. */
static void parse_job(const char *key) {
  char kind[16], name[FR_DIR_NAME_MAX + 1], again[FR_DIR_KEY_MAX + 1];
  if (!fr_dir_job_parse(key, kind, name))
    return;
  assert(*kind && *name && strlen(kind) < sizeof kind && strlen(name) <= FR_DIR_NAME_MAX);
  snprintf(again, sizeof again, FR_DIR_JOBS "%s/%s", kind, name);
  assert(strcmp(again, key) == 0);
}

static void decode_as_records(const uint8_t *data, size_t size) {
  fr_rd r = fr_rd_init(data, size);
  fr_dir_object o;
  fr_dir_node n;
  while (fr_rd_object(&r, &o)) {
    assert(o.desc.ndim <= FERRY_MAX_DIMS && o.generation != 0);
    parse_job(o.key);
  }
  r = fr_rd_init(data, size);
  while (fr_rd_node(&r, &n))
    assert(memchr(n.name, 0, sizeof n.name));
  r = fr_rd_init(data, size);
  int st;
  char detail[64];
  fr_rd_reply(&r, &st, detail, sizeof detail);
}

/* The input as a table slot (the sequence word even, so the reader goes past it). */
static void read_as_slot(const uint8_t *data, size_t size) {
  static uint64_t slot[FR_DIR_TABLE_SLOT_BYTES / 8];
  memset(slot, 0, sizeof slot);
  memcpy(slot, data, size < sizeof slot ? size : sizeof slot);
  slot[0] &= ~1ull;
  fr_dir_object o;
  if (fr_dir_table_read(slot, "k", &o))
    assert(strcmp(o.key, "k") == 0 && o.desc.ndim <= FERRY_MAX_DIMS && o.generation != 0);
  fr_dir_table_drop_owner(slot, 1, "n");
  fr_dir_table_publish(slot, "k", NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fr_dir_server *s = fr_dir_server_new("tcp://127.0.0.1:7700");
  size_t pos = 0;
  while (pos + 2 <= size) {
    size_t len = (size_t)data[pos] | (size_t)data[pos + 1] << 8;
    pos += 2;
    if (len > size - pos)
      len = size - pos;
    void *reply = NULL;
    size_t rlen = 0;
    fr_dir_server_handle(s, data + pos, len, &reply, &rlen);
    check_reply(reply, rlen);
    free(reply);
    pos += len;
  }
  fr_dir_server_expire(s, UINT64_MAX); /* drop everything through the lease path too */
  fr_dir_server_free(s);
  decode_as_records(data, size);
  read_as_slot(data, size);
  char key[FR_DIR_KEY_MAX + 1]; /* the raw input as a key, too */
  size_t n = size < FR_DIR_KEY_MAX ? size : FR_DIR_KEY_MAX;
  memcpy(key, data, n);
  key[n] = '\0';
  parse_job(key);
  return 0;
}
