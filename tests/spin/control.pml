/*
 * A model of ferry's control-cell protocol (src/control), checked by spin in the test suite
 * (tests/spin/run.sh): NR ranks, two controllers (the second may also abort, and may crash at
 * any point of a request), one command word written only by controllers with compare-and-swap,
 * one ack word per rank written only by that rank, and the outcome log written by the next
 * issuer. Every shared-word access is one atomic step, as in the C code; a rank's wait on the
 * command futex is a blocking guard (the kernel re-checks the word before sleeping, so a wake
 * cannot be missed; a wake lost to a crashed controller is covered by the wait's timeout).
 *
 * Checked (safety run, with invalid end states = deadlocks):
 *   - no lost command: a non-abort command is issued only when every rank acked the previous
 *     one, so no command is ever overwritten while in flight (the one-int32 bug);
 *   - a rank only skips a command that an abort superseded, and gets the latest;
 *   - update reaches only cleared ranks;
 *   - a controller's request ends OK only if every rank acked it, and ends "superseded" only if
 *     an abort followed it;
 *   - when all controllers are done (or dead) the ranks all reach the latest command (no
 *     deadlock) and, unless it was an abort, all ranks are in the same state.
 */
#ifndef NR
#define NR 2
#endif
#define NCTL 2
#define REQS 2
#define MAXSEQ 5 /* NCTL * REQS + 1 */

#define NONE 0
#define CLEAR 1
#define UPDATE 2
#define ABORT 3

#define SERVING 1
#define CLEARING 2
#define CLEARED 3
#define UPDATING 4

#define OUT_NONE 0
#define OUT_OK 1

/* the command word (seq, cmd): one 64-bit atomic in C */
byte cmd_seq = 0;
byte cmd = NONE;
/* rank lines: (seq, state), one 64-bit atomic each */
byte ack_seq[NR];
byte ack_state[NR];
/* the outcome log, written by controllers only */
byte outcome[MAXSEQ + 1];

/* ghosts: facts for the assertions, not part of the protocol */
byte issued[MAXSEQ + 1];    /* the command issued with each seq */
byte acked[MAXSEQ + 1];     /* how many ranks acked each seq with a final state */
byte finished = 0;          /* controllers done or dead */

#define FINAL(s) ((s) == SERVING || (s) == CLEARED)
#define DONE(i, s) (ack_seq[i] == (s) && FINAL(ack_state[i]))
#if NR == 2
#define ALLDONE(s) (DONE(0, s) && DONE(1, s))
#define ALLSAME (ack_state[0] == ack_state[1])
#else
#define ALLDONE(s) (DONE(0, s) && DONE(1, s) && DONE(2, s))
#define ALLSAME (ack_state[0] == ack_state[1] && ack_state[1] == ack_state[2])
#endif

proctype Rank(byte i) {
  byte taken = 0, c, k, mine = SERVING;
end:
  do
  :: atomic { cmd_seq > taken -> /* wait_command: one load of the word */
       k = taken + 1;
       do /* every skipped command was superseded by an abort */
       :: k < cmd_seq -> assert(issued[k + 1] == ABORT); k++
       :: else -> break
       od;
       taken = cmd_seq; c = cmd }
     if
     :: c == CLEAR ->
        atomic { ack_seq[i] = taken; ack_state[i] = CLEARING };
        atomic { ack_seq[i] = taken; ack_state[i] = CLEARED; acked[taken]++ };
        mine = CLEARED
     :: c == UPDATE ->
        assert(mine == CLEARED);
        atomic { ack_seq[i] = taken; ack_state[i] = UPDATING };
        atomic { ack_seq[i] = taken; ack_state[i] = SERVING; acked[taken]++ };
        mine = SERVING
     :: c == ABORT -> /* report what this rank can vouch for */
        atomic { ack_seq[i] = taken; ack_state[i] = mine; acked[taken]++ }
     fi
  od
}

proctype Controller(bit may_abort; bit may_crash) {
  byte n = 0, w_seq, w_cmd, mycmd, mine, i, st[NR];
  bool inflight, allcleared;
  do
  :: n < REQS ->
     n++;
     atomic { w_seq = cmd_seq; w_cmd = cmd }; /* snapshot: the word, then each line */
     inflight = false; allcleared = true; i = 0;
     do
     :: i < NR ->
        atomic { st[i] = ack_state[i]; inflight = inflight || !DONE(i, w_seq) };
        allcleared = allcleared && st[i] == CLEARED; i++
     :: else -> break
     od;
     if
     :: mycmd = CLEAR
     :: mycmd = UPDATE
     :: may_abort -> mycmd = ABORT
     fi;
     if
     :: mycmd != ABORT && inflight -> goto next         /* FERRY_EBUSY */
     :: mycmd == CLEAR && !inflight && allcleared -> goto next /* done at once */
     :: mycmd == UPDATE && !inflight && !allcleared -> goto next /* FERRY_ESTATE */
     :: else -> skip
     fi;
     if /* record the previous command's outcome before issuing */
     :: !inflight && w_seq > 0 -> outcome[w_seq] = OUT_OK
     :: else -> skip
     fi;
     atomic { /* the compare-and-swap */
       if
       :: cmd_seq == w_seq && cmd == w_cmd ->
          assert(mycmd == ABORT || acked[w_seq] == NR || w_seq == 0); /* nothing overwritten */
          cmd_seq = w_seq + 1; cmd = mycmd; issued[cmd_seq] = mycmd; mine = cmd_seq
       :: else -> goto next                              /* FERRY_EBUSY: lost the race */
       fi }
     if
     :: may_crash -> goto dead
     :: skip
     fi;
     do /* wait: the lines first, then the word */
     :: ALLDONE(mine) -> assert(acked[mine] == NR); break
     :: cmd_seq != mine && !ALLDONE(mine) ->
        if
        :: outcome[mine] == OUT_OK -> assert(acked[mine] == NR)
        :: else -> assert(issued[mine + 1] == ABORT)    /* FERRY_ECLOSED */
        fi;
        break
     :: may_crash -> goto dead
     od;
next: skip
  :: else -> break
  od;
dead:
  finished++
}

/* When every controller is done or dead, the ranks reach the latest command and agree. */
active proctype Quiet() {
  finished == NCTL;
  ALLDONE(cmd_seq) || cmd_seq == 0;
  assert(cmd == ABORT || cmd_seq == 0 || ALLSAME)
}

init {
  atomic {
    byte i = 0;
    do
    :: i < NR -> ack_seq[i] = 0; ack_state[i] = SERVING; run Rank(i); i++
    :: else -> break
    od;
    run Controller(0, 0);
    run Controller(1, 1)
  }
}
