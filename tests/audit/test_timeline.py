"""`kvledger audit timeline` (coordinator/audit/timeline.py) on a real simulator log: the model
against the index and against the log's own events, the PNG and HTML files, the command's errors."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from time import monotonic as _monotonic

import anyio
import pytest
import typer
from typer.testing import CliRunner

from coordinator.audit.store import indexed_seq, sync_index
from coordinator.audit.timeline import (
    Format,
    IndexRows,
    StepSpan,
    Timeline,
    TimelineError,
    build_timeline,
    load_timeline,
    output_format,
    parse_steps,
)
from coordinator.audit.timeline_draw import draw_timeline
from coordinator.cli.timeline import timeline_command
from coordinator.simulator.report import mixed_workload
from events import BlocksAllocated, EngineReset, EventCodec, NoticeDropped, OwnerStarted
from events.log import SqlEventLog, open_log
from events.log.reading import decode, stored_steps

STEPS = 40
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class SimLog:
    def __init__(self, indexed: Path, fresh: Path) -> None:
        self.indexed = indexed
        """The simulator's log, with its audit index built."""
        self.fresh = fresh
        """A copy taken before indexing: the command must catch the index up itself."""


@pytest.fixture(scope="module")
def sim_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimLog]:
    keep = tmp_path_factory.mktemp("timeline")
    report = anyio.run(lambda: mixed_workload(engines=1, steps=STEPS, keep=keep))
    assert report.wrong_reads == 0 and report.resets >= 1 and report.stores > 0 and report.loads > 0
    fresh = keep / "fresh.sqlite"
    shutil.copyfile(keep / "log.sqlite", fresh)

    async def index() -> None:
        event_log = await open_log(str(keep / "log.sqlite"))
        try:
            await sync_index(event_log)
        finally:
            await event_log.close()

    anyio.run(index)
    yield SimLog(keep / "log.sqlite", fresh)


class LogFacts:
    """What the log's events say, read without the index."""

    def __init__(self) -> None:
        self.allocations: list[tuple[int, int, int, int, int]] = []
        """seq, pool, block, generation, owner_id"""
        self.req_ids: dict[int, str] = {}
        self.resets: list[int] = []
        self.dropped: list[tuple[int, str]] = []


async def log_facts(event_log: SqlEventLog) -> LogFacts:
    facts, codec = LogFacts(), EventCodec()
    async for steps in stored_steps(event_log):
        for step in steps:
            for stored in step.events():
                event = decode(codec, stored)
                if isinstance(event, BlocksAllocated):
                    facts.allocations += [
                        (stored.global_seq, b.pool_id, b.block_id, b.generation, event.owner_id) for b in event.blocks
                    ]
                elif isinstance(event, OwnerStarted):
                    facts.req_ids[event.owner_id] = event.req_id
                elif isinstance(event, EngineReset):
                    facts.resets.append(stored.global_seq)
                elif isinstance(event, NoticeDropped):
                    facts.dropped.append((stored.global_seq, event.detail))
    return facts


async def _with_log(path: Path) -> tuple[SqlEventLog, Timeline, LogFacts]:
    event_log = await open_log(str(path))
    return event_log, await load_timeline(event_log, pool=0, first_step=1, last_step=STEPS), await log_facts(event_log)


# --- the model ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_holds_of_a_slot_never_overlap_and_generations_grow(sim_log: SimLog) -> None:
    """I1 as the picture shows it: one hold at a time per slot, each generation above the last."""
    event_log, timeline, _ = await _with_log(sim_log.indexed)
    try:
        assert timeline.engine == "wl-0" and (timeline.first_step, timeline.last_step) == (1, STEPS)
        assert timeline.bars and timeline.pins and timeline.jobs and timeline.slots
        for block in timeline.slots:
            bars = [b for b in timeline.bars if b.block == block]
            for before, after in zip(bars, bars[1:], strict=False):
                assert before.end_seq is not None and before.end_seq <= after.start_seq, (before, after)
                assert timeline.x_end(before.end_seq) <= timeline.x(after.start_seq)
                assert before.generation < after.generation, (before, after)
            for bar in bars:
                assert bar.start_step <= bar.end_step and bar.ended_by in ("freed", "reallocated", "reset", "open")
                assert (bar.end_seq is None) == (bar.ended_by == "open")
        for pin in timeline.pins:
            assert pin.start_seq <= timeline.last_seq and (pin.end_seq is None or pin.start_seq <= pin.end_seq)
            assert pin.kind in ("store", "load", "copy")
            job = next(j for j in timeline.jobs if j.job_id == pin.job_id)
            assert pin.block in job.blocks and job.kind == pin.kind
        xs = [timeline.x(seq) for seq in range(timeline.first_seq, timeline.last_seq + 2)]
        assert xs == sorted(xs) and xs[0] == timeline.first_step and xs[-1] == timeline.last_step + 1
    finally:
        await event_log.close()


@pytest.mark.anyio
async def test_every_allocation_reset_and_dropped_notice_in_the_log_is_drawn(sim_log: SimLog) -> None:
    event_log, timeline, facts = await _with_log(sim_log.indexed)
    try:
        allocations = [a for a in facts.allocations if a[1] == 0]
        assert allocations
        bars = {(b.block, b.generation, b.start_seq): b for b in timeline.bars}
        for seq, _, block, generation, owner in allocations:
            bar = bars[(block, generation, seq)]
            assert bar.owner_id == owner and bar.req_id == facts.req_ids[owner]
            assert bar.start_step == timeline.step_of(seq)
        assert len(timeline.bars) == len(allocations), "no reuse in this workload: one hold per allocation"
        [reset] = facts.resets
        by_reset = [b for b in timeline.bars if b.ended_by == "reset"]
        assert by_reset and all(b.end_seq == reset for b in by_reset)
        # A freed notice dropped because its slot was reallocated in the same step (I14): the
        # refusal sits on that slot's lane, where one hold ends by reallocation and the next begins.
        seq, detail = next((s, d) for s, d in facts.dropped if d.startswith("block 0/"))
        block = int(re.findall(r"block 0/(\d+)", detail)[0])
        mark = next(r for r in timeline.refusals if r.seq == seq)
        assert mark.block == block and mark.kind == "dropped" and mark.reason == "reallocated_in_step"
        assert any(b.block == block and b.ended_by == "reallocated" for b in timeline.bars)
    finally:
        await event_log.close()


@pytest.mark.anyio
async def test_a_narrow_range_is_the_wide_one_clipped(sim_log: SimLog) -> None:
    """Holds that began before the range (the generation each slot held when it began) and holds
    that go on after it are drawn, clipped; nothing else changes."""
    event_log = await open_log(str(sim_log.indexed))
    try:
        wide = await load_timeline(event_log, pool=0, first_step=1, last_step=STEPS)
        narrow = await load_timeline(event_log, pool=0, first_step=25, last_step=30)
    finally:
        await event_log.close()
    lo, hi = narrow.first_seq, narrow.last_seq
    expected = {
        (b.block, b.generation, b.start_seq, b.end_seq if b.end_seq is not None and b.end_seq <= hi else None)
        for b in wide.bars
        if b.start_seq <= hi and (b.end_seq is None or b.end_seq >= lo)
    }
    assert {(b.block, b.generation, b.start_seq, b.end_seq) for b in narrow.bars} == expected
    assert any(b.start_seq < lo and b.start_step == 25 for b in narrow.bars), "a hold from before the range"
    assert all(narrow.first_seq <= r.seq <= narrow.last_seq for r in narrow.refusals)


@pytest.mark.anyio
async def test_the_lane_cap_keeps_the_busiest_slots_and_says_so(sim_log: SimLog) -> None:
    event_log = await open_log(str(sim_log.indexed))
    try:
        capped = await load_timeline(event_log, pool=0, first_step=1, last_step=STEPS, max_slots=5)
        assert len(capped.slots) == 5 and capped.omitted_slots > 0 and "5 of" in capped.note
        assert {b.block for b in capped.bars} <= set(capped.slots)
        with pytest.raises(TimelineError, match="at most 10: narrow --steps"):
            await load_timeline(event_log, pool=0, first_step=1, last_step=STEPS, max_steps=10)
    finally:
        await event_log.close()


def test_cached_content_taken_back_after_its_free_is_a_new_hold() -> None:
    """The fold on its own (pure): reuse of a freed, cached slot; a late row of an old generation."""
    rows = IndexRows(
        engine="e",
        pool=1,
        steps=[StepSpan(1, 1, 10), StepSpan(2, 11, 20), StepSpan(3, 21, 30)],
        first_seq=1,
        last_seq=30,
        slots=[
            (4, 1, 2, "allocated", 7, None),
            (4, 1, 3, "computed", None, None),
            (4, 1, 5, "released", 7, None),
            (4, 1, 10, "freed", None, None),
            (4, 1, 12, "reused", 8, None),
            (4, 1, 13, "reused", 9, None),
            (4, 1, 15, "released", 8, None),
            (4, 2, 25, "allocated", 9, None),
            (4, 1, 26, "released", 9, None),
        ],
        resets=[],
        req_ids={7: "a", 8: "b"},
        jobs=[],
        refusals=[(14, "refused", "start_store", "slot_pinned", "block 2/4 is pinned by a job in flight")],
    )
    timeline = build_timeline(rows)
    first, second, third = timeline.bars
    assert (first.start_seq, first.end_seq, first.ended_by, first.released_seq) == (2, 10, "freed", 5)
    assert (second.owner_id, second.req_id, second.sharers, second.ended_by) == (8, "b", ["owner 9"], "reallocated")
    assert second.released_seq is None, "owner 9 still held it when the slot was reallocated"
    assert (third.generation, third.end_seq, third.ended_by, third.end_step) == (2, None, "open", 3)
    assert timeline.refusals == [], "a refusal naming another pool's slot is not this pool's"


def test_steps_and_suffix_are_checked() -> None:
    assert parse_steps("3:9") == (3, 9) and parse_steps(" 4 : 4 ") == (4, 4)
    for bad in ("5", "a:b", "9:3", "-1:4", "1:2:3"):
        with pytest.raises(TimelineError):
            parse_steps(bad)
    assert output_format(Path("x.PNG")) == "png" and output_format(Path("r/x.html")) == "html"
    with pytest.raises(TimelineError, match=r"\.png or \.html"):
        output_format(Path("x.svg"))


# --- the files ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_png_is_a_real_picture_drawn_off_the_event_loop(
    sim_log: SimLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STYLE.md 10: matplotlib draws (seconds of CPU) in a worker thread, and the loop keeps ticking
    meanwhile. Not a timing bound: a C call inside matplotlib may hold the GIL for a while on a
    loaded machine (0.62 s was seen in CI), so the test asserts where the drawing ran and that the
    loop went on serving while it did. Drawn on the loop, no tick could land inside the drawing."""
    from coordinator.audit import timeline_draw

    real_render = timeline_draw.render
    drawn: list[tuple[int, float, float]] = []

    def spy(timeline: Timeline, out: Path, kind: Format) -> None:  # the real drawing, with where and when it ran
        started = _monotonic()
        real_render(timeline, out, kind)
        drawn.append((threading.get_ident(), started, _monotonic()))

    monkeypatch.setattr(timeline_draw, "render", spy)
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(_monotonic())
            await anyio.sleep(0.01)

    out = tmp_path / "timeline.png"
    event_log = await open_log(str(sim_log.indexed))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await draw_timeline(event_log, pool=0, first_step=1, last_step=STEPS, out=out)
            tg.cancel_scope.cancel()
    finally:
        await event_log.close()
    [(thread, started, ended)] = drawn
    assert thread != threading.get_ident(), "the picture was drawn on the event loop's thread"
    during = [t for t in ticks if started < t < ended]
    assert during, f"the event loop did not tick once in the {ended - started:.2f} s of drawing"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    assert not list(tmp_path.glob(".*partial")), "no half-written file is left behind"
    image = pytest.importorskip("PIL.Image")
    with image.open(out) as picture:
        picture.verify()
        assert picture.format == "PNG" and picture.size[0] >= 1000 and picture.size[1] >= 700


@pytest.mark.anyio
async def test_html_is_self_contained(sim_log: SimLog, tmp_path: Path) -> None:
    out = tmp_path / "timeline.html"
    event_log = await open_log(str(sim_log.indexed))
    try:
        timeline = await draw_timeline(event_log, pool=1, first_step=1, last_step=STEPS, out=out)
    finally:
        await event_log.close()
    html = out.read_text(encoding="utf-8")
    assert "<html>" in html[:200].lower() and len(html) > 1_000_000, "plotly.js is inlined"
    assert "plotly.js v" in html and "Plotly.newPlot" in html
    assert not re.search(r"<script[^>]*\bsrc\s*=", html, re.IGNORECASE), "no script is fetched"
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']https?:", html, re.IGNORECASE)
    assert f"1/{timeline.slots[0]}" in html and "wl-0" in html


# --- the command --------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def audit() -> None:
        """The group the lead registers the command in."""

    app.command("timeline")(timeline_command)
    return app


runner = CliRunner()


def test_command_catches_the_index_up_and_draws(sim_log: SimLog, tmp_path: Path) -> None:
    out = tmp_path / "incident.html"
    result = runner.invoke(_app(), ["timeline", "0", "--steps", "10:30", "--out", str(out), "--log", str(sim_log.fresh)])
    assert result.exit_code == 0, (result.exception, result.output[-2000:])
    assert out.stat().st_size > 1_000_000 and "steps 10..30" in result.stdout

    async def caught_up() -> tuple[int, int]:
        event_log = await open_log(str(sim_log.fresh))
        try:
            return await indexed_seq(event_log), await event_log.head()
        finally:
            await event_log.close()

    indexed, head = anyio.run(caught_up)
    assert indexed == head > 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["0", "--steps", "12"], "not A:B"),
        (["0", "--steps", "30:10"], "after the last"),
        (["0", "--steps", "1:5", "--out", "{tmp}/x.svg"], ".png or .html"),
        (["0", "--steps", "1:5", "--engine", "nope"], "engine 'nope' is not in the log"),
        (["9", "--steps", "1:5"], "no pool 9"),
        (["0", "--steps", "500:600"], "no steps in 500..600 (its steps: 1..40)"),
        (["0", "--steps", "1:5", "--out", "{tmp}/missing/x.png"], "does not exist"),
        (["0", "--steps", "1:5", "--log", "{tmp}/nothing.sqlite"], "there is no log at"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(sim_log: SimLog, tmp_path: Path, args: list[str], says: str) -> None:
    base = {"--out": str(tmp_path / "x.png"), "--log": str(sim_log.indexed)}
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    for option, value in base.items():
        if option not in args:
            args += [option, value]
    result = runner.invoke(_app(), ["timeline", *args])
    assert result.exit_code == 2, (result.exception, result.output)
    assert says in result.stderr and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not (tmp_path / "nothing.sqlite").exists(), "an audit command never creates a log"
    assert not (tmp_path / "x.png").exists()


# --- reuse of a cached free slot, on a real log ---------------------------------------------------


async def _reuse_after_free_log(path: Path) -> dict[str, int]:
    """Block 1 of pool 0: allocated by "first" (step 2), computed, freed with its content kept
    (step 4: a cached free); "second" takes it back with ReuseBlocks (step 6: a prefix-cache hit,
    no new allocation, the same generation) and frees it (step 7); "third" takes it back (step 8).
    Returns each req_id's owner id."""
    from coordinator.core.commands import (
        AllocateBlocks,
        DeclareEngine,
        DeclareTier,
        FinishOwner,
        FreeBlocks,
        MarkComputed,
        ReuseBlocks,
        StartOwner,
    )
    from coordinator.ledger.ledger import Ledger
    from events import TierSpec
    from tests.kit import builders as b

    event_log = await open_log(str(path))
    try:
        ledger = await Ledger.open(event_log, clock=lambda: 1000.0)
        await ledger.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=16, bytes_per_slot=64)))
        await ledger.execute(
            DeclareEngine(engine_id="e", namespace=b.namespace(), pools=[b.attention_pool()], world_size=2, tiers=[b.TIER])
        )
        owners: dict[str, int] = {}

        async def start(step: int, req_id: str) -> int:
            commit = await ledger.run_step("e", step, float(step), [StartOwner(engine_id="e", req_id=req_id)])
            owners[req_id] = next(x for x in commit.events if isinstance(x, OwnerStarted)).owner_id
            return owners[req_id]

        first = await start(1, "first")
        commit = await ledger.run_step("e", 2, 2.0, [AllocateBlocks(engine_id="e", owner_id=first, pool_id=0, count=1)])
        [ref] = next(x for x in commit.events if isinstance(x, BlocksAllocated)).blocks
        assert ref.block_id == 1
        await ledger.run_step(
            "e", 3, 3.0, [MarkComputed(engine_id="e", owner_id=first, blocks=[ref], token_ids=list(range(b.BLOCK)))]
        )
        await ledger.run_step(
            "e", 4, 4.0, [FreeBlocks(engine_id="e", owner_id=first, blocks=[ref]), FinishOwner(engine_id="e", owner_id=first)]
        )
        second = await start(5, "second")
        await ledger.run_step("e", 6, 6.0, [ReuseBlocks(engine_id="e", owner_id=second, blocks=[ref])])
        await ledger.run_step("e", 7, 7.0, [FreeBlocks(engine_id="e", owner_id=second, blocks=[ref])])
        third = await start(8, "third")
        await ledger.run_step("e", 9, 9.0, [ReuseBlocks(engine_id="e", owner_id=third, blocks=[ref])])
        assert ledger.state.engines["e"].pools[0].refs[1] == 1 and ledger.state.engines["e"].pools[0].generations[1] == 1
        await sync_index(event_log)
        return owners
    finally:
        await event_log.close()


@pytest.mark.anyio
async def test_a_reuse_of_a_cached_free_slot_is_a_new_hold_of_the_same_generation(tmp_path: Path) -> None:
    """ReuseBlocks takes a ref on a slot that was freed with its content kept, without a new
    allocation: the state holds a ref (replayed at that step), so the picture must show a hold by
    the reusing owner, not a free slot. Each reuse after a free is a bar of its own."""
    from coordinator.ledger.recovery import replay

    path = tmp_path / "log.sqlite"
    owners = await _reuse_after_free_log(path)
    event_log = await open_log(str(path))
    try:
        timeline = await load_timeline(event_log, pool=0, first_step=1, last_step=9)
        bars = [
            (bar.generation, bar.req_id, bar.start_step, bar.end_step, bar.ended_by) for bar in timeline.bars if bar.block == 1
        ]
        assert bars == [(1, "first", 2, 4, "freed"), (1, "second", 6, 7, "freed"), (1, "third", 9, 9, "open")]
        assert [bar.owner_id for bar in timeline.bars if bar.block == 1] == [owners["first"], owners["second"], owners["third"]]
        # The state at the end of step 6 agrees: the second owner holds the slot.
        step_6 = next(span for span in timeline.steps if span.step == 6)
        state, _ = await replay(event_log, EventCodec(), until_seq=step_6.last_seq)
        holders = [o.owner_id for o in state.owners.values() if o.blocks.get(0, {}).get(1) == 1]
        assert holders == [owners["second"]] and state.engines["e"].pools[0].refs[1] == 1
        held = [
            bar
            for bar in timeline.bars
            if bar.block == 1 and bar.start_seq <= step_6.last_seq and (bar.end_seq is None or bar.end_seq > step_6.last_seq)
        ]
        assert [bar.owner_id for bar in held] == holders
        # A range that begins after the first free still finds the reuse (it reads the generation
        # each slot held when the range began).
        narrow = await load_timeline(event_log, pool=0, first_step=6, last_step=8)
        assert [(bar.req_id, bar.start_step, bar.end_step, bar.ended_by) for bar in narrow.bars if bar.block == 1] == [
            ("second", 6, 7, "freed")
        ]
    finally:
        await event_log.close()


# --- odd input and the console ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["0", "--steps", "1:99999999999999999999"], "a step is at most 9223372036854775807"),
        (["0", "--steps", "99999999999999999999:99999999999999999999"], "a step is at most"),
    ],
)
def test_steps_past_what_a_log_holds_are_bad_input(sim_log: SimLog, tmp_path: Path, args: list[str], says: str) -> None:
    result = runner.invoke(_app(), ["timeline", *args, "--out", str(tmp_path / "x.png"), "--log", str(sim_log.indexed)])
    assert result.exit_code == 2, (result.exception, result.output)
    assert says in result.stderr and "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert isinstance(result.exception, SystemExit)


def test_a_pool_past_what_a_log_holds_is_bad_input(sim_log: SimLog, tmp_path: Path) -> None:
    result = runner.invoke(
        _app(),
        ["timeline", "99999999999999999999", "--steps", "1:5", "--out", str(tmp_path / "x.png"), "--log", str(sim_log.indexed)],
    )
    assert result.exit_code == 2 and "2147483647" in result.output and "Traceback" not in result.output


def test_the_command_prints_no_debug_lines(sim_log: SimLog, tmp_path: Path) -> None:
    """Like every audit command (coordinator/cli/audit.py quiet_logs): the answer on stdout, and
    only warnings and up on stderr."""
    out = tmp_path / "x.png"
    result = runner.invoke(_app(), ["timeline", "0", "--steps", "1:3", "--out", str(out), "--log", str(sim_log.indexed)])
    assert result.exit_code == 0, (result.exception, result.output[-2000:])
    assert result.stdout.startswith(f"{out}: engine wl-0 pool 0, steps 1..3") and len(result.stdout.splitlines()) == 1
    assert "debug" not in result.output and "audit_index_synced" not in result.output
    assert "audit_timeline_drawn" not in result.output
