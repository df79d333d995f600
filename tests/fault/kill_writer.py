"""A writer process for the SIGKILL tests: ``python kill_writer.py ROOT JOURNAL TRIAL``.

Opens a BlockStore under ROOT, prints ``ready``, waits for a line on stdin
(so the parent can start it ahead of time), then stores keys
``key(0, TRIAL), key(1, TRIAL), ...`` in jobs of ``JOB_KEYS`` until it is
killed. The journal (append-only, one line per fact) tells the parent what it
may rely on:

- ``B <n>`` before a job is submitted: keys ``0 .. n-1`` may be on disk;
- ``S <hex key>`` after a job completed (poll() returned it) for each of its
  keys the store reports present, flushed and fsynced before the next job.

A process kill never loses a completed write() to the journal, so every
``S`` line is a store that completed before the kill.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faultkit import ROW, ROWS, key, new_buffer, open_store, payload

JOB_KEYS = 8


def main() -> None:
    root, journal_path, trial = sys.argv[1], sys.argv[2], int(sys.argv[3])
    buf = new_buffer(ROWS)
    store = open_store(root, buf)
    journal = os.open(journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    print("ready", flush=True)
    sys.stdin.readline()
    i = 0
    job_id = 0
    while True:
        keys = [key(i + j, trial) for j in range(JOB_KEYS)]
        rows = [(i + j) % ROWS for j in range(JOB_KEYS)]
        for k, r in zip(keys, rows, strict=True):
            buf[r * ROW : (r + 1) * ROW] = payload(k)
        os.write(journal, f"B {i + JOB_KEYS}\n".encode())
        store.submit_store(job_id, keys, rows)
        while not (done := store.poll()):
            time.sleep(0.0002)
        assert len(done) == 1 and done[0].success, done
        present = [k for k in keys if store.contains(k)]
        os.write(journal, b"".join(f"S {k.hex()}\n".encode() for k in present))
        os.fsync(journal)
        i += JOB_KEYS
        job_id += 1


if __name__ == "__main__":
    main()
