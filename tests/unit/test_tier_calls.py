"""nvmetier._table.FinishedJobs and NewRequest: the tier's get_finished_jobs()
and on_new_request() in C (native/nvt_tier_calls.c).

FinishedJobs: a call takes no arguments and calls ``poll()`` once; an empty
result (any sized empty sequence) returns ``empty`` itself, anything else
returns ``report(result)``, or with ``make``, a list where each plain store's
outcome is made by ``make`` and every other entry is reported alone, in
place; what either raises reaches the caller; the members may be replaced or
deleted at any time without a crash. NewRequest: ``track(ctx.req_id, ctx)``,
then ``answer``.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
from nvmetier._table import FinishedJobs


def test_nothing_finished_returns_empty_without_calling_report() -> None:
    reported = []
    sentinel = ()
    for nothing in ((), [], b"", {}):
        fj = FinishedJobs(lambda n=nothing: n, reported.append, sentinel)
        assert fj() is sentinel
    assert reported == []
    assert FinishedJobs(list, reported.append)() == ()  # empty defaults to ()


def test_something_finished_is_reported_once_as_polled() -> None:
    polls = [[(1, True)], (), [(2, False), (3, True)]]
    reported = []

    def report(done):
        reported.append(done)
        return ["result", len(done)]

    fj = FinishedJobs(lambda: polls.pop(0), report, ())
    assert fj() == ["result", 1]
    assert fj() == ()
    assert fj() == ["result", 2]
    assert reported == [[(1, True)], [(2, False), (3, True)]]


def test_errors_of_poll_and_report_reach_the_caller() -> None:
    def poll():
        raise OSError("poll failed")

    with pytest.raises(OSError, match="poll failed"):
        FinishedJobs(poll, print)()

    def report(done):
        raise ValueError("report failed")

    with pytest.raises(ValueError, match="report failed"):
        FinishedJobs(lambda: [1], report)()
    # A result without a length: the error, not a guess.
    with pytest.raises(TypeError):
        FinishedJobs(lambda: 7, print)()


def test_bad_arguments_are_refused_clearly() -> None:
    with pytest.raises(TypeError, match="callable"):
        FinishedJobs(1, print)
    with pytest.raises(TypeError, match="callable"):
        FinishedJobs(list, None)
    fj = FinishedJobs(list, print)
    with pytest.raises(TypeError, match="no arguments"):
        fj(1)
    with pytest.raises(TypeError, match="no arguments"):
        fj(timeout=1)


def test_deleted_or_replaced_members_are_safe() -> None:
    fj = FinishedJobs(list, print, "none")
    del fj.poll
    with pytest.raises(TypeError, match="must be set"):
        fj()
    with pytest.raises(AttributeError):
        fj.poll  # noqa: B018
    fj.poll = lambda: [1]
    fj.report = lambda done: ("reported", done)
    assert fj() == ("reported", [1])

    # A poll that replaces the members while it runs: the report it set is
    # the one called; a report that deletes itself runs to its end; the next
    # call, with `empty` gone, is a clear error (checked before any call).
    fj2 = FinishedJobs(list, print)

    def new_report(done):
        del fj2.report
        return ("new", done)

    def poll():
        fj2.poll = list
        fj2.report = new_report
        del fj2.empty
        return [9]

    fj2.poll = poll
    assert fj2() == ("new", [9])
    with pytest.raises(TypeError, match="must be set"):
        fj2()


def test_reference_cycle_through_report_is_collected() -> None:
    class Owner:
        def report(self, done):
            return done

    owner = Owner()
    owner.fj = FinishedJobs(list, owner.report)  # type: ignore[attr-defined]
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None


def test_no_reference_is_leaked_on_any_path() -> None:
    empty, done = object(), [(1, True)]

    def raising():
        raise KeyError("x")

    fj_empty = FinishedJobs(list, print, empty)
    fj_done = FinishedJobs(lambda: done, lambda d: d)
    fj_raise = FinishedJobs(raising, print)
    before = (sys.getrefcount(empty), sys.getrefcount(done))
    for _ in range(3):  # warm caches before counting blocks
        fj_empty(), fj_done()
    blocks = sys.getallocatedblocks()
    for _ in range(20000):
        assert fj_empty() is empty
        assert fj_done() is done
        with pytest.raises(KeyError):
            fj_raise()
    gc.collect()
    assert (sys.getrefcount(empty), sys.getrefcount(done)) == before
    assert sys.getallocatedblocks() - blocks < 50


def test_make_builds_plain_stores_and_reports_the_rest_in_place() -> None:
    made = []

    def make(*args):
        made.append(args)
        return ("made", args[0])

    reported = []

    def report(done):
        reported.append(list(done))
        return [("reported", raw[0]) for raw in done]

    plain = (1, True, None, 0.5, 64, None, False)
    plain_keys = (2, True, [b"k"], 0.1, 32, None, False)
    plain_empty_keys = (3, True, [], 0.1, 32, None, False)
    load = (4, True, None, 0.2, 64, None, True)
    failed = (5, False, None, 0.2, 0, None, False)
    errored = (6, True, None, 0.2, 64, "boom", False)
    odd = [7, True, None, 0.2, 64, None, False]  # not a tuple
    polls = [[plain, load, plain_keys, failed, errored, odd, plain_empty_keys]]
    fj = FinishedJobs(lambda: polls.pop(0) if polls else [], report, (), make)
    assert fj() == [
        ("made", 1),
        ("reported", 4),
        ("made", 2),
        ("reported", 5),
        ("reported", 6),
        ("reported", 7),
        ("made", 3),
    ]
    assert made == [
        (1, True, None, 0.5, 64),
        (2, True, [b"k"], 0.1, 32),
        (3, True, None, 0.1, 32),  # `ok_keys or None`, as the Python report
    ]
    assert reported == [[load], [failed], [errored], [odd]]
    assert fj() == ()


def test_make_errors_reach_the_caller_and_leak_nothing() -> None:
    def make(*args):
        raise RuntimeError("make failed")

    with pytest.raises(RuntimeError, match="make failed"):
        FinishedJobs(lambda: [(1, True, None, 0.1, 1, None, False)], print, (), make)()
    with pytest.raises(TypeError, match="sequence"):
        FinishedJobs(lambda: [(1, True, None, 0.1, 1, None, True)], lambda d: 5, (), tuple)()
    with pytest.raises(TypeError, match="callable"):
        FinishedJobs(list, print, (), 3)
    raws = [(i, True, None, 0.1, 1, None, i % 3 == 0) for i in range(6)]
    fj = FinishedJobs(lambda: raws, lambda d: [d[0][0]], (), lambda *a: a[0])
    blocks = sys.getallocatedblocks()
    for _ in range(20000):
        assert fj() == [0, 1, 2, 3, 4, 5]
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 50


def test_new_request_tracks_by_req_id_and_answers() -> None:
    from nvmetier._table import NewRequest

    class Ctx:
        def __init__(self, req_id):
            self.req_id = req_id

    waiting: dict = {}
    answer = object()
    nr = NewRequest(waiting.__setitem__, answer)
    a, b = Ctx("a"), Ctx("b")
    assert nr(a) is answer and nr(req_context=b) is answer
    assert waiting == {"a": a, "b": b}
    with pytest.raises(TypeError, match="req_context"):
        nr()
    with pytest.raises(TypeError, match="req_context"):
        nr(a, b)
    with pytest.raises(TypeError, match="req_context"):
        nr(ctx=a)
    with pytest.raises(AttributeError):
        nr(object())  # no req_id: the error, nothing tracked
    with pytest.raises(TypeError, match="callable"):
        NewRequest(None, answer)

    def raising(req_id, ctx):
        raise KeyError(req_id)

    with pytest.raises(KeyError):
        NewRequest(raising, answer)(a)
    # A track that deletes the answer: a clear error, never a crash.
    nr2 = NewRequest(lambda req_id, ctx: delattr(nr2, "answer"), answer)
    with pytest.raises(TypeError, match="must be set"):
        nr2(a)
    blocks = sys.getallocatedblocks()
    for _ in range(20000):
        nr(a)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 50


_DELETES_DURING_POLL = """
from nvmetier._table import FinishedJobs
for member, found, make in (
    ("report", [1], None),
    ("empty", [], None),
    ("report", [(1, True, None, 0.1, 1, None, True)], tuple),
):
    def poll(member=member, found=found):
        delattr(fj, member)
        return found
    fj = FinishedJobs(poll, lambda done: done, (), make)
    try:
        fj()
    except TypeError as e:
        assert "must be set" in str(e), e
    else:
        raise AssertionError(member + " deleted by poll: no error")
print("ok")
"""


def test_a_member_poll_deletes_is_an_error_not_a_crash() -> None:
    # The member the answer needs (report, or empty) deleted by poll() itself:
    # read after poll returns, it must be checked again (a child process: a
    # NULL dereference kills it, not this test run).
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _DELETES_DURING_POLL], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_schedule_end_releases_then_ends_the_step() -> None:
    from nvmetier._table import ScheduleEnd

    class Ctx:
        new_req_ids = ("a",)
        preempted_req_ids = ("b",)

    calls: list = []
    se = ScheduleEnd(lambda: calls.append("release"), lambda new, pre: calls.append((new, pre)))
    assert se(Ctx()) is None and se(context=Ctx()) is None
    assert calls == ["release", (("a",), ("b",))] * 2
    with pytest.raises(TypeError, match="context"):
        se()
    with pytest.raises(AttributeError):
        se(object())  # no new_req_ids: the error, after the release
    with pytest.raises(TypeError, match="callable"):
        ScheduleEnd(None, print)

    def failing():
        raise OSError("release failed")

    with pytest.raises(OSError):
        ScheduleEnd(failing, lambda n, p: calls.append("never"))(Ctx())
    assert "never" not in calls
    se2 = ScheduleEnd(lambda: delattr(se2, "end_step"), print)
    del se2.release
    with pytest.raises(TypeError, match="must be set"):
        se2(Ctx())
    blocks = sys.getallocatedblocks()
    for _ in range(20000):
        se(Ctx())
    calls.clear()
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 50


def test_submit_store_submits_logs_refusals_and_runs_once_first() -> None:
    from nvmetier._table import SubmitStore

    class Job:
        def __init__(self, job_id, keys, chunk_ids):
            self.job_id, self.keys, self.chunk_ids = job_id, keys, chunk_ids

    submitted: list = []
    refused: list = []
    answers = iter([None, "engine closed", None])

    def submit(job_id, keys, rows):
        submitted.append((job_id, keys, rows))
        return next(answers)

    order: list = []

    def once():
        order.append("once")
        st.submit = lambda *a: order.append("new submit") or submit(*a)

    st = SubmitStore(submit, lambda job_id, err: refused.append((job_id, err)), once)
    assert st(Job(1, [b"k"], [3])) is None
    assert st(job_metadata=Job(2, [b"j"], [4])) is None
    assert st(Job(3, [], [])) is None
    # once ran first, once, and its new submit took every job.
    assert order == ["once", "new submit", "new submit", "new submit"] and st.once is None
    assert submitted == [(1, [b"k"], [3]), (2, [b"j"], [4]), (3, [], [])]
    assert refused == [(2, "engine closed")]
    with pytest.raises(TypeError, match="job_metadata"):
        st()
    with pytest.raises(AttributeError):
        st(object())
    with pytest.raises(TypeError, match="callable"):
        SubmitStore(print, print, 5)

    def bad_once():
        raise RuntimeError("seed check failed")

    st2 = SubmitStore(submit, print, bad_once)
    with pytest.raises(RuntimeError):
        st2(Job(9, [], []))
    assert st2.once is None  # cleared before it ran: never twice
    ok = SubmitStore(lambda *a: None, print)
    job = Job(5, [b"x"], [1])
    blocks = sys.getallocatedblocks()
    for _ in range(20000):
        ok(job)
    gc.collect()
    assert sys.getallocatedblocks() - blocks < 50


_POLL_LIST_CHANGED = """
import sys
from nvmetier._table import FinishedJobs

found = []


class Keys(list):
    def __len__(self):  # ok_keys' truth, asked by the make path: Python code
        found.clear()
        return 1


def report(done):
    found.clear()
    return ["reported"]


stores = [(i, True, None, 0.1, 1, None, False) for i in range(2, 50)]
for first in (
    (1, True, None, 0.1, 1, None, True),  # a load: report() runs
    (1, True, Keys([b"k"]), 0.1, 1, None, False),  # a store: its keys' len() runs
):
    found[:] = [first, *stores]
    fj = FinishedJobs(lambda: found, report, (), lambda *a: a[0])
    out = fj()
    assert out in (["reported"], [1]), out
print("ok")
"""


def test_a_polled_list_changed_while_it_is_answered_is_no_crash() -> None:
    # With make, the answer calls Python code (report, make, an ok_keys'
    # truth) between the entries of the list poll() returned: a list that
    # code empties must be read again, never past its end (a child process:
    # a crash kills it, not this run).
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _POLL_LIST_CHANGED], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])


_MEDDLING = """
import gc
import random
import sys

from nvmetier._table import FinishedJobs, NewRequest, ScheduleEnd, SubmitStore

MEMBERS = {
    FinishedJobs: ("poll", "report", "empty", "make"),
    NewRequest: ("track", "answer"),
    ScheduleEnd: ("release", "end_step"),
    SubmitStore: ("submit", "refused", "once"),
}


class Ctx:
    req_id = "r"
    new_req_ids = ()
    preempted_req_ids = ()
    job_id = 1
    keys = (b"k",)
    chunk_ids = (0,)


for seed in range(int(sys.argv[1])):
    rng = random.Random(seed)
    polled = []
    answers = [None, "refused", [], [1, 2], (), polled]
    objs = []
    depth = [0]
    ok = [0]

    def call(o):
        if depth[0] > 3:
            return
        depth[0] += 1
        try:
            o() if isinstance(o, FinishedJobs) else o(Ctx())
            ok[0] += 1
        finally:
            depth[0] -= 1

    def meddle(*args, **kwargs):
        # Delete, replace or clear what the calls use, call one again.
        for _ in range(rng.randint(0, 3)):
            o = rng.choice(objs)
            member = rng.choice(MEMBERS[type(o)])
            r = rng.random()
            try:
                if r < 0.3:
                    delattr(o, member)
                elif r < 0.6:
                    setattr(o, member, meddle)
                elif r < 0.7:
                    setattr(o, member, None)
                else:
                    setattr(o, member, rng.choice(answers))
            except (AttributeError, TypeError):
                pass
            if rng.random() < 0.2:
                polled.clear()
            if rng.random() < 0.1:
                try:
                    call(rng.choice(objs))
                except Exception:
                    pass
        return rng.choice(answers)

    def poll():
        meddle()
        polled[:] = [
            (i, True, None, 0.1, 1, None, rng.random() < 0.5) for i in range(rng.randint(0, 6))
        ]
        return polled

    def fresh():
        objs[:] = [
            FinishedJobs(poll, meddle, (), meddle),
            NewRequest(meddle, 1),
            ScheduleEnd(meddle, meddle),
            SubmitStore(meddle, meddle, meddle),
        ]

    fresh()
    for i in range(20000):
        try:
            call(rng.choice(objs))
        except Exception:
            pass
        if i % 50 == 0:
            fresh()
    gc.collect()
    assert ok[0] > 1000, ok
print("ok")
"""


def test_calls_whose_callables_meddle_with_everything_never_crash() -> None:
    # Every callable deletes, replaces or clears members of any of the four
    # types (its own included), empties the list poll() returned, or calls
    # one of them again, at random: errors, never a crash (a child process).
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _MEDDLING, "8"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr[-2000:])
