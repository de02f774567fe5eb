"""Drawing a `Timeline` (coordinator/audit/timeline.py): PNG with matplotlib's Agg canvas (no
display, no pyplot state), HTML with plotly, plotly.js inlined so the file works offline.

Both draw the same picture: one lane per slot (pool/block), a bar per hold coloured by owner and
labelled with its generation and owner, the tail after the last owner let go paler (the slot is
freed at the end of the step, I14, or later when a job pins it: draining, I3), a thin dark band per pin coloured by job kind, and two lanes on
top for jobs (start and end) and for refusals that name no slot; a refusal that names a slot is
marked on its lane. matplotlib and plotly are imported only when a picture is drawn: they take
seconds to import, and every other `kvledger` command would pay for it at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import anyio
import structlog

from coordinator.audit.timeline import MAX_SLOTS, MAX_STEPS, Bar, Format, Timeline, TimelineError, load_timeline, output_format
from events.log import SqlEventLog

log = structlog.get_logger("kvledger.audit.timeline")

# ColorBrewer Set3: light enough that the pin bands and markers stay readable on top.
OWNER_COLORS = [
    "#8dd3c7",
    "#ffffb3",
    "#bebada",
    "#fb8072",
    "#80b1d3",
    "#fdb462",
    "#b3de69",
    "#fccde5",
    "#bc80bd",
    "#ccebc5",
    "#ffed6f",
    "#d9d9d9",
]
NO_OWNER = "#eeeeee"
PIN_COLORS = {"store": "#08306b", "load": "#00441b", "copy": "#54278f"}
OTHER_PIN = "#444444"
OUTCOME_COLORS = {"succeeded": "#2ca02c", "failed": "#d62728", "fenced": "#ff7f0e"}
REFUSAL_COLOR = "#d62728"
JOBS_LANE, REFUSALS_LANE = 0, 1
PIN_OFFSET = 0.2
"""Pins run in the lower part of their lane, below the hold's label."""
LABELS_UP_TO = 400
"""Bars labelled in the PNG at most (past that the labels are unreadable anyway)."""


async def draw_timeline(
    event_log: SqlEventLog,
    *,
    pool: int,
    first_step: int,
    last_step: int,
    out: Path,
    engine: str | None = None,
    max_steps: int = MAX_STEPS,
    max_slots: int = MAX_SLOTS,
) -> Timeline:
    """Read the range from the index and draw it to `out` (.png or .html); returns the model."""
    kind = output_format(out)  # before any query: a bad name fails fast
    if not await anyio.Path(out.parent).is_dir():
        raise TimelineError(f"--out {str(out)!r}: the directory {str(out.parent)!r} does not exist")
    timeline = await load_timeline(
        event_log, pool=pool, first_step=first_step, last_step=last_step, engine=engine, max_steps=max_steps, max_slots=max_slots
    )
    # Drawing is seconds of CPU and a file write: off the event loop (STYLE.md 10).
    await anyio.to_thread.run_sync(render, timeline, out, kind)
    log.debug(
        "audit_timeline_drawn",
        engine=timeline.engine,
        pool=pool,
        first_step=timeline.first_step,
        last_step=timeline.last_step,
        bars=len(timeline.bars),
        pins=len(timeline.pins),
        out=str(out),
    )
    return timeline


def render(timeline: Timeline, out: Path, kind: Format) -> None:
    """Write the picture to `out`, whole or not at all (a temporary file, then a rename)."""
    partial = out.with_name(f".{out.name}.partial")
    try:
        (_png if kind == "png" else _html)(timeline, partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


# --- shared geometry ----------------------------------------------------------------------------


def owner_color(owner_id: int | None) -> str:
    return NO_OWNER if owner_id is None else OWNER_COLORS[owner_id % len(OWNER_COLORS)]


def outcome_color(outcome: str) -> str:
    return OUTCOME_COLORS.get(outcome.split(":")[0], OUTCOME_COLORS["failed"])


def _lanes(timeline: Timeline) -> tuple[list[str], Callable[[int], int]]:
    lane = {block: 2 + i for i, block in enumerate(timeline.slots)}
    labels = ["jobs", "refusals"] + [f"{timeline.pool}/{block}" for block in timeline.slots]
    return labels, lane.__getitem__


def _title(timeline: Timeline) -> str:
    title = (
        f"engine {timeline.engine}, pool {timeline.pool}: steps {timeline.first_step}..{timeline.last_step} "
        f"(seq {timeline.first_seq}..{timeline.last_seq}), {len(timeline.bars)} holds, {len(timeline.pins)} pins, "
        f"{len(timeline.jobs)} jobs, {len(timeline.refusals)} refusals"
    )
    return f"{title}\n{timeline.note}" if timeline.note else title


def _bar_text(timeline: Timeline, bar: Bar) -> str:
    end = "still held" if bar.end_seq is None else f"{bar.ended_by} at seq {bar.end_seq} (step {bar.end_step})"
    lines = [
        f"slot {timeline.pool}/{bar.block} generation {bar.generation}",
        f"owner {bar.owner_id if bar.owner_id is not None else '-'}" + (f" ({bar.req_id})" if bar.req_id else ""),
        f"from seq {bar.start_seq} (step {bar.start_step}), {end}",
    ]
    if bar.released_seq is not None:
        lines.append(f"last owner let go at seq {bar.released_seq}")
    if bar.sharers:
        lines.append("shared with " + ", ".join(bar.sharers))
    return "<br>".join(lines)


def _bar_label(bar: Bar) -> str:
    return f"g{bar.generation}" + (f" o{bar.owner_id}" if bar.owner_id is not None else "")


# --- PNG ----------------------------------------------------------------------------------------


def _png(timeline: Timeline, path: Path) -> None:
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    labels, lane = _lanes(timeline)
    height = min(2.8 + 0.28 * len(labels), 60.0)
    figure = Figure(figsize=(14, height), dpi=100)
    FigureCanvasAgg(figure)
    # Fixed margins in inches: constrained layout would draw the whole picture twice.
    figure.subplots_adjust(
        left=1.0 / 14, right=1 - 0.25 / 14, top=1 - (1.0 if timeline.note else 0.7) / height, bottom=1.5 / height
    )
    ax = figure.add_subplot()
    x, x_end = timeline.x, timeline.x_end

    def spans(rows: list[tuple[float, float, float]], half: float, **style: object) -> None:
        """Rectangles (y, start, end) as one collection: one artist, not one patch per bar."""
        corners = [[(start, y - half), (start, y + half), (end, y + half), (end, y - half)] for y, start, end in rows]
        ax.add_collection(PolyCollection(corners, **style))  # type: ignore[arg-type]

    held = [(b, x(b.start_seq), x_end(b.released_seq if b.released_seq is not None else b.end_seq)) for b in timeline.bars]
    spans(
        [(lane(b.block), start, end) for b, start, end in held],
        0.35,
        facecolors=[owner_color(b.owner_id) for b, _, _ in held],
        edgecolors="#555555",
        linewidths=0.4,
    )
    draining = [b for b in timeline.bars if b.released_seq is not None]
    spans(
        [(lane(b.block), x(b.released_seq), x_end(b.end_seq)) for b in draining if b.released_seq is not None],
        0.35,
        facecolors=[owner_color(b.owner_id) for b in draining],
        alpha=0.35,
        edgecolors="#999999",
        linewidths=0.4,
        hatch="//",
    )
    if len(timeline.bars) <= LABELS_UP_TO:
        span = timeline.last_step + 1 - timeline.first_step
        for bar, start, end in held:
            if (end - start) / span > 0.03:
                ax.text(
                    (start + end) / 2, lane(bar.block) - 0.1, _bar_label(bar), ha="center", va="center", fontsize=7, clip_on=True
                )
    pins = timeline.pins
    spans(
        [(lane(p.block) + PIN_OFFSET, x(p.start_seq), x_end(p.end_seq)) for p in pins],
        0.1,
        facecolors=[PIN_COLORS.get(p.kind, OTHER_PIN) for p in pins],
        linewidths=0,
    )

    jobs = timeline.jobs
    started = [j for j in jobs if j.start_seq >= timeline.first_seq]
    ax.scatter(
        [x(j.start_seq) for j in started],
        [JOBS_LANE] * len(started),
        marker=">",
        s=30,
        zorder=3,
        color=[PIN_COLORS.get(j.kind, OTHER_PIN) for j in started],
    )
    ended = [(j, j.end_seq) for j in jobs if j.end_seq is not None]
    ax.scatter(
        [x(seq) for _, seq in ended],
        [JOBS_LANE] * len(ended),
        marker="o",
        s=30,
        zorder=3,
        color=[outcome_color(j.outcome) for j, _ in ended],
        edgecolor="black",
        linewidth=0.4,
    )
    refusals = timeline.refusals
    ax.scatter(
        [x(r.seq) for r in refusals],
        [REFUSALS_LANE if r.block is None else lane(r.block) for r in refusals],
        marker="X",
        color=REFUSAL_COLOR,
        edgecolor="white",
        linewidth=0.4,
        s=60,
        zorder=4,
    )

    ax.set_yticks(range(len(labels)), labels, fontsize=7 if len(labels) > 40 else 9)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first lane on top
    ax.set_xlim(timeline.first_step, timeline.last_step + 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_xlabel("engine step")
    ax.set_ylabel("slot (pool/block)")
    ax.set_title(_title(timeline), fontsize=10)
    handles: list[Artist] = [
        Patch(facecolor=OWNER_COLORS[0], edgecolor="#555555", label="held (colour: owner; gN oM: generation, owner)"),
        Patch(
            facecolor=OWNER_COLORS[0], alpha=0.35, hatch="//", label="owners gone, not yet free (end of step; pinned: draining)"
        ),
    ]
    handles += [Patch(facecolor=color, label=f"pin: {kind} job") for kind, color in PIN_COLORS.items()]
    handles += [
        Line2D([], [], marker=">", linestyle="", color="#444444", label="job started"),
        Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            color=OUTCOME_COLORS["succeeded"],
            label="job ended (green ok, red failed, orange fenced)",
        ),
        Line2D([], [], marker="X", linestyle="", color=REFUSAL_COLOR, label="refusal"),
    ]
    figure.legend(handles=handles, loc="lower center", ncols=4, fontsize=8, frameon=False)
    figure.savefig(path, format="png")


# --- HTML ---------------------------------------------------------------------------------------


def _html(timeline: Timeline, path: Path) -> None:
    import plotly.graph_objects as go  # type: ignore[import-untyped]

    labels, lane = _lanes(timeline)
    x, x_end = timeline.x, timeline.x_end
    figure = go.Figure()
    bars = timeline.bars
    held_end = [x_end(b.released_seq if b.released_seq is not None else b.end_seq) for b in bars]
    figure.add_trace(
        go.Bar(
            name="held (colour: owner)",
            orientation="h",
            y=[lane(b.block) for b in bars],
            base=[x(b.start_seq) for b in bars],
            x=[e - x(b.start_seq) for b, e in zip(bars, held_end, strict=True)],
            width=0.7,
            marker={"color": [owner_color(b.owner_id) for b in bars], "line": {"color": "#555555", "width": 0.5}},
            text=[_bar_label(b) for b in bars],
            textposition="inside",
            insidetextanchor="middle",
            hovertext=[_bar_text(timeline, b) for b in bars],
            hoverinfo="text",
        )
    )
    draining = [b for b in bars if b.released_seq is not None]
    figure.add_trace(
        go.Bar(
            name="owners gone, not yet free",
            orientation="h",
            y=[lane(b.block) for b in draining],
            base=[x(b.released_seq) for b in draining if b.released_seq is not None],
            x=[x_end(b.end_seq) - x(b.released_seq) for b in draining if b.released_seq is not None],
            width=0.7,
            opacity=0.4,
            marker={"color": [owner_color(b.owner_id) for b in draining], "pattern": {"shape": "/"}},
            hovertext=[_bar_text(timeline, b) for b in draining],
            hoverinfo="text",
        )
    )
    for kind, color in PIN_COLORS.items():
        pins = [p for p in timeline.pins if p.kind == kind]
        figure.add_trace(
            go.Bar(
                name=f"pin: {kind} job",
                orientation="h",
                y=[lane(p.block) + PIN_OFFSET for p in pins],
                base=[x(p.start_seq) for p in pins],
                x=[x_end(p.end_seq) - x(p.start_seq) for p in pins],
                width=0.2,
                marker={"color": color},
                hovertext=[
                    f"job {p.job_id} ({p.kind}) pins {timeline.pool}/{p.block}@g{p.generation}<br>"
                    f"seq {p.start_seq}..{p.end_seq if p.end_seq is not None else 'after the range'}: {p.outcome}"
                    for p in pins
                ],
                hoverinfo="text",
            )
        )
    jobs = timeline.jobs
    started = [j for j in jobs if j.start_seq >= timeline.first_seq]
    figure.add_trace(
        go.Scatter(
            name="job started",
            mode="markers",
            x=[x(j.start_seq) for j in started],
            y=[JOBS_LANE] * len(started),
            marker={"symbol": "triangle-right", "size": 9, "color": [PIN_COLORS.get(j.kind, OTHER_PIN) for j in started]},
            hovertext=[f"job {j.job_id} {j.kind} started at seq {j.start_seq}: {j.detail}<br>slots {j.blocks}" for j in started],
            hoverinfo="text",
        )
    )
    ended = [j for j in jobs if j.end_seq is not None]
    figure.add_trace(
        go.Scatter(
            name="job ended",
            mode="markers",
            x=[x(j.end_seq) for j in ended if j.end_seq is not None],
            y=[JOBS_LANE] * len(ended),
            marker={
                "symbol": "circle",
                "size": 9,
                "color": [outcome_color(j.outcome) for j in ended],
                "line": {"color": "black", "width": 0.5},
            },
            hovertext=[f"job {j.job_id} {j.kind} ended at seq {j.end_seq}: {j.outcome}" for j in ended],
            hoverinfo="text",
        )
    )
    refusals = timeline.refusals
    figure.add_trace(
        go.Scatter(
            name="refusal",
            mode="markers",
            x=[x(r.seq) for r in refusals],
            y=[REFUSALS_LANE if r.block is None else lane(r.block) for r in refusals],
            marker={"symbol": "x", "size": 11, "color": REFUSAL_COLOR, "line": {"color": "white", "width": 0.5}},
            hovertext=[f"{r.kind} at seq {r.seq} (step {r.step}): {r.subject}: {r.reason}<br>{r.detail}" for r in refusals],
            hoverinfo="text",
        )
    )
    figure.update_layout(
        title={"text": _title(timeline).replace("\n", "<br>"), "font": {"size": 13}},
        barmode="overlay",
        height=max(420, 22 * len(labels) + 200),
        plot_bgcolor="white",
        xaxis={
            "title": "engine step",
            "range": [timeline.first_step, timeline.last_step + 1],
            "gridcolor": "#dddddd",
            "zeroline": False,
        },
        yaxis={
            "title": "slot (pool/block)",
            "tickvals": list(range(len(labels))),
            "ticktext": labels,
            "range": [len(labels) - 0.5, -0.5],
        },
        uniformtext={"minsize": 8, "mode": "hide"},
        legend={"orientation": "h", "y": -0.12},
        margin={"l": 80, "r": 20, "t": 80, "b": 60},
    )
    # include_plotlyjs=True inlines plotly.js: the report opens with no network at all.
    figure.write_html(str(path), include_plotlyjs=True, full_html=True, config={"displaylogo": False})
