/*
 * A version sent in parts from CUDA memory (against the stand-in driver, tests/cudastub, or a
 * GPU's): the sender declared its tensors in host memory (a plan made from a first version
 * staged on the host, as push_iter does), and each later version's tensors are device memory
 * the trainer gathers a few at a time: ferry_refit_set_data points the tensors there (the sender
 * pins its buffers at the first), each part copies them device to host, the device memory is
 * freed once ferry_refit_part_sent says so, and the receiver holds exactly the version.
 */
// ferry-test: cuda
// ferry-test: threaded
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NT 12

static bool have_cuda;

static int group_setup(void **st) {
  (void)st;
  have_cuda = tu_cuda_use();
  return 0;
}

static ferry_ctx *ctx_for(const char *name) {
  ferry_ctx_opts o = {.size = sizeof o, .name = name, .transports = "shm,tcp"};
  ferry_ctx *c;
  FR_OK(ferry_ctx_open(&o, &c));
  return c;
}

static uint64_t elems(int i) { return 100 + (uint64_t)i * 37; }

static void fill(float *w, int i, uint64_t version) {
  for (uint64_t k = 0; k < elems(i); k++)
    w[k] = (float)((k * 3 + (uint64_t)i + version * 11) % 500);
}

static void test_parts_from_device(void **st) {
  (void)st;
  if (!have_cuda)
    skip();
  ferry_ctx *sc = ctx_for("trainer"), *rc = ctx_for("rollout");
  ferry_refit_opts o = {.size = sizeof o, .bucket_bytes = 1024};
  ferry_refit_sender *s;
  FR_OK(ferry_refit_sender_open(sc, "trainer", &o, &s));
  float *host[NT], *got[NT];
  ferry_tensor_desc d[NT];
  char name[NT][16];
  for (int i = 0; i < NT; i++) {
    d[i] = (ferry_tensor_desc){.dtype = FERRY_DTYPE_F32, .ndim = 1, .shape = {elems(i)}};
    snprintf(name[i], sizeof name[i], "w%d", i);
    host[i] = malloc(elems(i) * 4);
    got[i] = calloc(elems(i), 4);
    fill(host[i], i, 1);
    FR_OK(ferry_refit_declare(s, name[i], &d[i], host[i], FERRY_DTYPE_INVALID));
  }
  FR_OK(ferry_refit_seal(s));
  ferry_refit_receiver *r;
  FR_OK(ferry_refit_receiver_open(rc, ferry_ctx_address(sc), 5000, &r));
  for (int i = 0; i < NT; i++)
    FR_OK(ferry_refit_bind(r, name[i], got[i], &d[i]));
  for (int i = 0; i < 500 && ferry_refit_receivers(s) < 1; i++)
    usleep(10000);
  FR_OK(ferry_refit_push(s, 1, NULL));
  FR_OK(ferry_refit_wait(r, 1, 10000, NULL));
  void *dev[NT] = {0};
  int freed = 0;
  for (int i = 0; i < NT; i++) { /* version 2, gathered on the device */
    fill(host[i], i, 2);
    FR_OK(ferry_cuda_alloc(0, elems(i) * 4, &dev[i]));
    assert_int_equal(ferry_mem_where(dev[i], NULL), FERRY_MEM_CUDA);
    FR_OK(ferry_mem_copy(dev[i], host[i], elems(i) * 4));
    FR_OK(ferry_refit_set_data(s, name[i], dev[i]));
    ferry_refit_push_opts po = {.size = sizeof po,
                                .part = i == NT - 1 ? FERRY_REFIT_PART_LAST : FERRY_REFIT_PART_MORE,
                                .timeout_ms = 10000};
    FR_OK(ferry_refit_push(s, 2, &po));
    for (int j = 0; j <= i && i < NT - 1; j++)
      if (dev[j] && ferry_refit_part_sent(s, name[j]) == 1) {
        FR_OK(ferry_cuda_free(dev[j]));
        dev[j] = NULL;
        freed++;
      }
  }
  assert_true(freed > 0);
  FR_OK(ferry_refit_wait(r, 2, 10000, NULL));
  for (int i = 0; i < NT; i++) {
    assert_memory_equal(got[i], host[i], elems(i) * 4);
    if (dev[i])
      FR_OK(ferry_cuda_free(dev[i]));
    free(host[i]);
    free(got[i]);
  }
  ferry_refit_receiver_close(r);
  ferry_refit_sender_close(s);
  ferry_ctx_close(rc);
  ferry_ctx_close(sc);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parts_from_device),
  };
  tu_filter();
  return cmocka_run_group_tests(tests, group_setup, NULL);
}
