/*
 * The mq's metrics: publishes per topic (counted by the publish itself under publish_lock, plain
 * stores: a publish in a stream takes no other lock and no locked instruction for them), receives
 * per topic (counted as a message is queued, under mq->lock, in a bounded table: a node that
 * subscribes to more than FR_MQ_STAT_TOPICS topics counts the rest under topic "_other"), the
 * queue's depth, and waits for credit (a subscriber's full queue holding a publisher back).
 */
#include "mq/mq.h"
#include "core/stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The row of topic (lock held), when it is not the last one matched (fr_mq_count_received). */
fr_mq_rx_stat *fr_mq_rx_row(ferry_mq *mq, const char *topic) {
  for (size_t i = 0; i < mq->nrx; i++)
    if (strcmp(mq->rx[i].name, topic) == 0) {
      mq->rx_last = i;
      return &mq->rx[i];
    }
  if (mq->nrx < FR_MQ_STAT_TOPICS) {
    char *name = strdup(topic);
    if (name) {
      mq->rx[mq->nrx] = (fr_mq_rx_stat){.name = name, .len = strlen(name)};
      mq->rx_last = mq->nrx;
      return &mq->rx[mq->nrx++];
    }
  }
  return &mq->rx[FR_MQ_STAT_TOPICS];
}

static void collect(void *arg, fr_stats_out *out) {
  ferry_mq *mq = arg;
  const char *n = mq->name;
  fr_stat_counter(out, "ferry_mq_publish_errors_total",
                  "Publishes that failed (no credit in time, a dead subscriber, bad input)",
                  (double)fr_counted(&mq->publish_errors), "mq", n, NULL);
  pthread_mutex_lock(&mq->lock);
  for (fr_mq_topic *t = mq->topics; t; t = t->next) {
    fr_stat_counter(out, "ferry_mq_published_total", "Messages published, by topic",
                    (double)fr_counted(&t->published), "mq", n, "topic", t->name, NULL);
    fr_stat_counter(out, "ferry_mq_published_bytes_total", "Payload bytes published, by topic",
                    (double)fr_counted(&t->published_bytes), "mq", n, "topic", t->name, NULL);
    fr_stat_gauge(out, "ferry_mq_subscribers", "Subscribers a published topic reaches now",
                  (double)t->nsubs, "mq", n, "topic", t->name, NULL);
  }
  for (size_t i = 0; i <= FR_MQ_STAT_TOPICS; i++) {
    const fr_mq_rx_stat *r = &mq->rx[i];
    if (!r->name && (i < FR_MQ_STAT_TOPICS || r->msgs == 0))
      continue;
    const char *topic = r->name ? r->name : "_other";
    fr_stat_counter(out, "ferry_mq_received_total", "Messages received (queued here), by topic",
                    (double)r->msgs, "mq", n, "topic", topic, NULL);
    fr_stat_counter(out, "ferry_mq_received_bytes_total", "Payload bytes received, by topic",
                    (double)r->bytes, "mq", n, "topic", topic, NULL);
  }
  fr_stat_gauge(out, "ferry_mq_queue_messages",
                "Messages received and not yet taken by the application", (double)mq->queued, "mq",
                n, NULL);
  fr_stat_counter(out, "ferry_mq_credit_waits_total",
                  "Publishes that waited for a subscriber's queue to have room",
                  (double)mq->credit_waits, "mq", n, NULL);
  fr_stat_counter(out, "ferry_mq_credit_wait_seconds_total",
                  "Time publishes spent waiting for subscribers' queues to have room",
                  (double)mq->credit_wait_ns * 1e-9, "mq", n, NULL);
  pthread_mutex_unlock(&mq->lock);
}

static int ready(void *arg, char *why, size_t len) {
  ferry_mq *mq = arg;
  return mq->dir ? fr_dir_lease_ready(&mq->lease, why, len) : 0;
}

int fr_mq_stats_start(ferry_mq *mq) {
  return fr_stats_add(fr_ctx_stats(mq->ctx), collect, ready, mq);
}

void fr_mq_stats_stop(ferry_mq *mq) { fr_stats_remove(fr_ctx_stats(mq->ctx), mq); }

void fr_mq_stats_free(ferry_mq *mq) {
  for (size_t i = 0; i < mq->nrx; i++)
    free(mq->rx[i].name);
  mq->nrx = mq->rx_last = 0;
}
