/*
 * The design ferry's control cell replaces, as a contrast for tests/spin/run.sh: one int32 in
 * shared memory written by both the API server and rank 0, which reads it, broadcasts it to the
 * other ranks and writes it back. spin must find the lost command: the server's UPDATE written
 * between rank 0's read and its write-back is overwritten, and the server waits forever (in the
 * engine, until the 300 s timeout). The assertion says what must hold for no command to be lost:
 * a write-back never overwrites a value rank 0 did not read. run.sh fails if spin finds NO error
 * here, which would mean the checker setup cannot see this class of bug.
 */
mtype = { SERVING, CLEAR, CLEARED, UPDATE };
mtype state = SERVING;

active proctype ApiServer() {
  state = CLEAR;
  state == CLEARED;
  state = UPDATE;
  state == SERVING /* a lost UPDATE leaves this waiting: an invalid end state */
}

active proctype Rank0() {
  mtype v, seen;
end:
  do
  :: v = state; /* read, then broadcast v to the other ranks, which act on it */
     seen = v;
     if
     :: v == CLEAR -> v = CLEARED
     :: v == UPDATE -> v = SERVING
     :: else -> skip
     fi;
     atomic { assert(state == seen); state = v } /* write back */
  od
}
