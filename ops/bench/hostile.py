"""Benchmark: a legitimate engine's step latency while hostile clients attack the sidecar (issue 17).

    .venv/bin/python ops/bench/hostile.py [--steps 1000] [--rounds 5] [--commands 32] [--warmup 100] [--seed 7]

Starts a real `kvledger serve` subprocess on SQLite in a temporary directory, with a credentials
file (coordinator/sidecar/credentials.py) as the operator of a shared node would write one: the
legitimate engine `legit` (token: roles engine, engines ["legit"]), an observer, and the attacker,
a tenant of its own (`mallory`: roles engine and worker for the engines of tenant mallory), and
budgets sized for the node: --max-tier-slots 131,072 (the legit tier's 65,536 and as many again),
--max-pool-blocks 81,920 (the legit pool's 65,536 and room for the attacker's), and
--max-owners-per-engine 4,096, --frame-timeout 2.

First `legit` declares (one attention pool of 65,536 blocks, the benchmark tier) and runs
--warmup steps (not timed; they also give the log the history a catch-up reads). Then this script
starts itself again as the attacker process (--attacker), which opens its connections, prints
`attacking` once every attack has begun, and runs every attack in a loop until it is stopped.
The timed steps (exactly --commands commands each: ops/bench/sidecar.py's EngineLoad: start,
allocate, mark computed, finish; nothing refused; each timed from send to reply) run in --rounds
rounds of two phases: alone, with the attacker stopped (SIGSTOP, and SETTLE seconds for what it
had sent to be served), then under attack (SIGCONT, and RESUME seconds for its attacks to be back
under way). Alone and under attack in turns, the host's drift falls on both alike: with one long
phase of each, the same code measured a p99 ratio anywhere from 1.8 to 3.3 on one afternoon.
The attacks are those issue 17 reproduced, each from a client written from the protocol alone:

- forge: Hello as legit's worker, as legit itself, and as an operator, with mallory's token;
- takeover: a Hello declaring `legit` (in mallory's namespace) with takeover;
- collide: engines `team` and `team/a` stepping with ids "a/s1" and "s1" (and reusing them);
- poison: steps numbered 2**63-1 and at clock 1e18 on mallory's own engine;
- step control: Steps and Executes carrying BeginStep/EndStep;
- lookups: Lookups of 262,144 token ids (the most a Lookup may hash; packed) and of 65,536 (the
  most it may list), and of one more of each;
- catch-up: 20 connections subscribing from sequence 0 as workers of mallory's engine (which
  read the whole log, and now reads the engine's own stream) and of made-up engines, again as
  soon as they caught up;
- big steps: Steps of the most commands a Step may hold, each refused;
- huge frames: Steps as large as the sidecar takes (MAX_DENSE_FRAME, 128 KiB) of one-byte token
  ids, then one as large as a Lookup may be (--max-frame, 1.25 MiB), refused by its first bytes;
- dense frames: Steps of 128 KiB of block references, the costliest element to decode
  (~40 ns a byte, against ~10 for one-byte ints; refused: owner 1 is unknown);
- tiers: declarations of 2**24-slot tiers; pools: a declaration of 64 pools of 2**24 blocks;
- owners: Steps that start 1,000 owners and never finish them, until the budget refuses them;
- stalls: 50 connections that send 1-3 bytes of a frame header and go silent, again once cut;
- garbage: frames of random bytes, and frames that announce 16 MiB and send nothing more.

The attacker's payloads are encoded once, before it says `attacking`, so its own CPU goes to
sending. It shares the machine's cores with the sidecar and the legitimate engine: on a 2-core
machine three busy processes share two cores, and the figures say so (the load average and the
CPU each process used are printed).

The sidecar's resident memory (VmRSS, /proc) is read before the attacker starts and every 100 ms
after; the growth is the largest reading less the first. Prints the legit
engine's p50/p99/max alone and under attack, what each attack got back (counts of replies by
kind, and a sample of each refusal), and the targets: `p99 under attack <= 2x alone`, `<= 50
ms`, `RSS growth <= 50 MiB`, each met or MISSED; the last lines are plain `key value` lines:

    p99 alone ms X
    p99 under attack ms Y
    p99 ratio Z
    rss growth MiB W
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import msgspec  # noqa: E402
import structlog  # noqa: E402
from figures import console, core_build, load, out, percentile  # noqa: E402
from sidecar import TIER, EngineLoad, cpu_seconds, server_output, stop, wait_ready  # noqa: E402

from coordinator.client import Address, EngineClient  # noqa: E402
from coordinator.core.checks import MAX_LOOKUP_TOKENS  # noqa: E402
from coordinator.core.commands import (  # noqa: E402
    AnyCommand,
    BeginStep,
    DeclareEngine,
    DeclareTier,
    EndStep,
    FinishOwner,
    FreeBlocks,
    MarkComputed,
    StartOwner,
)
from coordinator.sidecar import protocol as p  # noqa: E402
from coordinator.sidecar.admission import MAX_COMMANDS_PER_STEP  # noqa: E402
from events import BlockRef, TierSpec  # noqa: E402
from tests.kit import builders as b  # noqa: E402
from tests.kit.sidecar import RawConnection  # noqa: E402

LEGIT = "legit"
MALLORY = "mallory"
LEGIT_TOKEN = "legit-engine-" + "l" * 24
OBSERVER_TOKEN = "observer-" + "o" * 24
MALLORY_TOKEN = "mallory-" + "m" * 24
NUM_BLOCKS = 1 << 16
MALLORY_BLOCKS = 4096
BUDGET = {
    "--max-tier-slots": 2 * TIER.num_slots,
    "--max-pool-blocks": NUM_BLOCKS + 4 * MALLORY_BLOCKS,
    "--max-owners-per-engine": 4096,
    "--frame-timeout": 2,
}
P99_RATIO_TARGET = 2.0
P99_TARGET_MS = 50.0
RSS_TARGET_MIB = 50.0
SUBSCRIBERS = 20
STALLERS = 50
START_TIMEOUT = 60.0
SETTLE = 0.3
"""Seconds between stopping the attacker (SIGSTOP) and an alone round: what it had sent is served."""
RESUME = 0.5
"""Seconds between resuming the attacker (SIGCONT) and an attacked round: its attacks are back under way."""

CREDENTIALS = f"""
[[credentials]]
name = "legit"
token = "{LEGIT_TOKEN}"
roles = ["engine", "worker"]
engines = ["{LEGIT}"]

[[credentials]]
name = "observer"
token = "{OBSERVER_TOKEN}"
roles = ["observer"]

[[credentials]]
name = "mallory"
token = "{MALLORY_TOKEN}"
roles = ["engine", "worker"]
tenant = "{MALLORY}"
"""


def declaration(engine_id: str, tenant: str, num_blocks: int) -> DeclareEngine:
    return DeclareEngine(
        engine_id=engine_id,
        namespace=b.namespace(tenant=tenant),
        world_size=2,
        tiers=[b.TIER],
        pools=[b.attention_pool(num_blocks=num_blocks)],
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# --- the legitimate engine -------------------------------------------------------------------------


class Legit:
    def __init__(self, socket_path: str, commands: int, seed: int) -> None:
        self.client = EngineClient(
            Address(socket_path=socket_path, token=LEGIT_TOKEN),
            declaration(LEGIT, "legit", NUM_BLOCKS),
            tiers=[TIER],
            retry_for=60.0,
        )
        self.load = EngineLoad(LEGIT, commands, seed)

    async def steps(self, count: int) -> list[float]:
        latencies = []
        for _ in range(count):
            commands, concern = self.load.plan()
            self.load.step += 1
            before = time.perf_counter()
            result = await self.client.step(
                self.load.step, self.load.step * 0.01, commands, command_id=self.load.next_command_id()
            )
            latencies.append(time.perf_counter() - before)
            self.load.follow(result, concern)
        return latencies


def figures(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)
    return percentile(ordered, 0.50) * 1e3, percentile(ordered, 0.99) * 1e3, ordered[-1] * 1e3


# --- the attacker process -------------------------------------------------------------------------


class Raw(RawConnection):
    """One connection, framed by hand: what a client written from protocol.py alone sends."""

    async def ask(self, frame: bytes) -> p.ServerMessage:
        await self.send_bytes(frame)
        return await self.receive()


def hello(role: str, engine_id: str = "", **fields: object) -> bytes:
    return p.frame(p.Hello(protocol=p.PROTOCOL_VERSION, role=role, engine_id=engine_id, token=MALLORY_TOKEN, **fields))  # type: ignore[arg-type]


def _with_id(frame: bytes, command_id: str) -> bytes:
    """A Step frame encoded with command id "{id}", with `command_id` in its place (re-framed)."""
    body = frame[p.HEADER_BYTES :].replace(b"\xa4{id}", msgspec.msgpack.encode(command_id), 1)
    return len(body).to_bytes(p.HEADER_BYTES, "big") + body


def step(number: int, clock: float, commands: list[AnyCommand], command_id: str) -> bytes:
    return p.frame(p.Step(step=number, clock=clock, commands=commands, command_id=command_id))


class Tally:
    """What each attack got back: reply kinds (an Error by its code), and one sample of each."""

    def __init__(self) -> None:
        self.replies: dict[str, Counter[str]] = {}
        self.samples: dict[tuple[str, str], str] = {}

    def note(self, attack: str, reply: p.ServerMessage | str) -> None:
        if isinstance(reply, str):
            kind, sample = reply, reply
        elif isinstance(reply, p.Error):
            kind, sample = f"error {reply.code.value}", reply.message
        elif isinstance(reply, p.StepResult):
            refused = [e for e in reply.began + [x for r in reply.results for x in r] if type(e).__name__ == "Refused"]
            kind = f"step, refused {getattr(refused[0], 'reason', '')}" if refused else "step committed"
            sample = str(getattr(refused[0], "detail", ""))[:160] if refused else ""
        else:
            kind, sample = type(reply).__name__, ""
        self.replies.setdefault(attack, Counter())[kind] += 1
        self.samples.setdefault((attack, kind), sample[:200])

    def print(self) -> None:
        for attack, kinds in sorted(self.replies.items()):
            detail = "; ".join(f"{kind} x{n}" for kind, n in kinds.most_common())
            print(f"attack {attack}: {detail}", flush=True)
            for kind in kinds:
                sample = self.samples.get((attack, kind))
                if sample:
                    print(f"  {kind}: {sample}", flush=True)


Attack = Callable[[], Awaitable[None]]


ATTACK_NAMES = (
    "forge",
    "takeover",
    "collide",
    "poison",
    "step-control",
    "lookups",
    "big-steps",
    "tiers-pools",
    "owners",
    "garbage",
    "huge-frames",
    "dense-frames",
    "catch-up",
    "stalls",
)
"""What --attacks may name (the attacker's names, below)."""


async def attacker(socket_path: str, only: frozenset[str] = frozenset()) -> None:
    """Run every attack in a loop, forever; `attacking` on stdout once each has begun."""
    tally = Tally()
    rng = random.Random(7)
    attacks: list[tuple[str, Attack]] = []

    async def ask(name: str, conn: Raw, frame: bytes) -> None:
        tally.note(name, await conn.ask(frame))

    async def engine(name: str, engine_id: str) -> Raw:
        conn = await Raw.open(Path(socket_path))
        await ask(
            name,
            conn,
            hello("engine", engine_id, declare=declaration(engine_id, MALLORY, MALLORY_BLOCKS), tiers=[TIER], takeover=True),
        )
        return conn

    async def forge() -> None:
        for frame in (
            hello("worker", LEGIT, rank=0),
            hello("engine", LEGIT, declare=declaration(LEGIT, MALLORY, NUM_BLOCKS)),
            hello("operator"),
        ):
            conn = await Raw.open(Path(socket_path))
            await ask("forge", conn, frame)
            await conn.aclose()

    async def takeover() -> None:
        conn = await Raw.open(Path(socket_path))
        await ask("takeover", conn, hello("engine", LEGIT, declare=declaration(LEGIT, MALLORY, NUM_BLOCKS), takeover=True))
        await conn.aclose()

    async def collide() -> None:
        team, team_a = await engine("collide", "team"), await engine("collide", "team/a")
        for n in range(1, 50):
            await ask("collide", team, step(n, n, [StartOwner(engine_id="team", req_id="secret")], f"a/s{n}"))
            await ask("collide", team_a, step(n, n, [FinishOwner(engine_id="team/a", owner_id=1)], f"s{n}"))
            await ask("collide", team_a, step(n + 1, n, [], f"s{n}"))  # the id again, with other content
        await team.aclose()
        await team_a.aclose()

    async def poison() -> None:
        conn = await engine("poison", "mallory-poison")
        for n in range(20):
            await ask("poison", conn, step(2**63 - 1, 1.0, [], f"p{n}"))
            await ask("poison", conn, step(1 + n, 1e18, [], f"c{n}"))
        await conn.aclose()

    control = [
        step(1, 1.0, [BeginStep(engine_id="mallory-control", step=5, clock=5.0)], "bs"),
        p.frame(p.Execute(command=EndStep(engine_id="mallory-control"), command_id="es")),
    ]

    async def step_control() -> None:
        conn = await engine("step-control", "mallory-control")
        for _ in range(20):
            for frame in control:
                await ask("step-control", conn, frame)
        await conn.aclose()

    heavy = [
        p.frame(p.lookup_message(TIER.name, [rng.randrange(50_000) for _ in range(n)]))
        for n in (MAX_LOOKUP_TOKENS, p.MAX_LISTED_TOKENS)
    ]  # packed, and the longest list
    over = [
        p.frame(p.lookup_message(TIER.name, list(range(MAX_LOOKUP_TOKENS + 1)))),
        p.frame(p.Lookup(tier=TIER.name, token_ids=list(range(MAX_LOOKUP_TOKENS + 1)))),
    ]

    async def lookups() -> None:
        conn = await engine("lookups", "mallory-lookups")
        for _ in range(5):
            for frame in heavy + over:
                await ask("lookups", conn, frame)
        await conn.aclose()

    def subscriber(index: int) -> Attack:
        engine_id = "mallory-lookups" if index % 2 == 0 else f"made-up-{index}"

        async def subscribe() -> None:
            conn = await Raw.open(Path(socket_path))
            await ask("catch-up", conn, hello("worker", engine_id, rank=0))
            await conn.stream.send(p.frame(p.Subscribe(from_seq=0)))
            with anyio.move_on_after(1.0):  # what the catch-up sends; then again from 0
                while True:
                    tally.note("catch-up", await conn.receive())
            await conn.aclose()

        return subscribe

    big = [FinishOwner(engine_id="mallory-big", owner_id=10**9 + i) for i in range(MAX_COMMANDS_PER_STEP)]
    big_frames = [p.frame(p.Step(step=n, clock=float(n), commands=big, command_id="{id}")) for n in range(1, 6)]
    rounds = 0

    async def big_steps() -> None:
        nonlocal rounds
        conn = await engine("big-steps", "mallory-big")  # declared again: its steps begin afresh
        rounds += 1
        for n, frame in enumerate(big_frames):
            # A fresh command id each time (one reused would be answered from the log as a duplicate).
            await ask("big-steps", conn, _with_id(frame, f"big-{rounds}-{n}"))
        await conn.aclose()

    # The largest Step the sidecar takes, as many ints as it can hold (one byte each; refused
    # afterwards: owner 1 is unknown), and one as large as a Lookup may be (refused by its header
    # and first bytes: a 1.25 MiB Step of ints held the GIL ~27 ms while it was decoded).
    def filled(n: int) -> list[AnyCommand]:
        return [MarkComputed(engine_id="mallory-huge", owner_id=1, blocks=[], token_ids=[i % 128 for i in range(n)])]

    huge_frame = step(1, 1.0, filled(p.MAX_DENSE_FRAME - 256), "huge")
    over_frame = step(1, 1.0, filled(p.MAX_REQUEST_FRAME - 256), "huge")

    async def huge_frames() -> None:
        conn = await engine("huge-frames", "mallory-huge")  # declared again: its step 1 is new
        for _ in range(5):
            await ask("huge-frames", conn, huge_frame)
        await ask("huge-frames", conn, over_frame)  # and the connection is closed
        await conn.aclose()

    # The largest Step, of block references: they cost ~40 ns a byte to decode (a one-byte int ~10),
    # ~5 ms for this one (at 256 KiB, decoded on the event loop, ~10 ms).
    ref = BlockRef(pool_id=0, block_id=1, generation=1)
    dense = [FreeBlocks(engine_id="mallory-dense", owner_id=1, blocks=[ref] * (p.MAX_DENSE_FRAME // 4 - 64))]
    dense_frame = step(1, 1.0, dense, "dense")

    async def dense_frames() -> None:
        conn = await engine("dense-frames", "mallory-dense")
        for _ in range(5):
            await ask("dense-frames", conn, dense_frame)
        await conn.aclose()

    huge_tier = p.frame(
        p.Execute(command=DeclareTier(spec=TierSpec(name="huge", num_slots=1 << 24, bytes_per_slot=64)), command_id="t")
    )
    many_pools = DeclareEngine(
        engine_id="mallory-pools",
        namespace=b.namespace(tenant=MALLORY, block_sizes=(b.BLOCK,) * 64),
        world_size=2,
        tiers=[b.TIER],
        pools=[b.attention_pool(pool_id=i, num_blocks=1 << 24) for i in range(64)],
    )

    async def tiers_pools() -> None:
        conn = await engine("tiers-pools", "mallory-tiers")
        await ask("tiers-pools", conn, huge_tier)
        await conn.aclose()
        conn = await Raw.open(Path(socket_path))
        await ask("tiers-pools", conn, hello("engine", "mallory-pools", declare=many_pools))
        await conn.aclose()

    owner_frames = [
        step(n, float(n), [StartOwner(engine_id="mallory-owners", req_id=f"o{n}-{i}") for i in range(1000)], "{id}")
        for n in range(1, 8)
    ]

    async def owners() -> None:
        nonlocal rounds
        conn = await engine("owners", "mallory-owners")  # declared again: the last round's owners are let go
        rounds += 1
        for n, frame in enumerate(owner_frames):
            await ask("owners", conn, _with_id(frame, f"owners-{rounds}-{n}"))
        await conn.aclose()

    def staller(index: int) -> Attack:
        async def stall() -> None:
            conn = await Raw.open(Path(socket_path))
            await conn.stream.send(hello("observer")[: 1 + index % 3])
            with anyio.move_on_after(30):
                tally.note("stalls", await conn.receive())  # cut after the frame timeout
            await conn.aclose()

        return stall

    async def garbage() -> None:
        conn = await Raw.open(Path(socket_path))
        await ask("garbage", conn, (64).to_bytes(4, "big") + rng.randbytes(64))
        await conn.aclose()
        conn = await Raw.open(Path(socket_path))
        await conn.stream.send((16 << 20).to_bytes(4, "big"))  # announces 16 MiB, sends nothing more
        with anyio.move_on_after(30):
            tally.note("garbage", await conn.receive())
        await conn.aclose()

    attacks += [
        ("forge", forge),
        ("takeover", takeover),
        ("collide", collide),
        ("poison", poison),
        ("step-control", step_control),
        ("lookups", lookups),
        ("big-steps", big_steps),
        ("tiers-pools", tiers_pools),
        ("owners", owners),
        ("garbage", garbage),
        ("huge-frames", huge_frames),
        ("dense-frames", dense_frames),
    ]
    attacks += [("catch-up", subscriber(i)) for i in range(SUBSCRIBERS)]
    attacks += [("stalls", staller(i)) for i in range(STALLERS)]
    assert {name for name, _ in attacks} == set(ATTACK_NAMES)
    if only:
        attacks[:] = [(name, body) for name, body in attacks if name in only]
    begun = 0

    def mark_begun() -> None:
        nonlocal begun
        begun += 1
        if begun == len(attacks):
            print("attacking", flush=True)

    async def forever(name: str, body: Attack) -> None:
        first = True
        while True:
            if first and name == "stalls":  # a stall's first round ends only when it is cut
                first = False
                mark_begun()
            try:
                await body()
            except (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as error:
                tally.note(name, f"connection ended ({type(error).__name__})")
            if first:
                first = False
                mark_begun()
            await anyio.sleep(0.01)

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            for name, body in attacks:
                tg.start_soon(forever, name, body)
            async for _ in signals:
                tally.print()
                tg.cancel_scope.cancel()
                break


# --- the run -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=1000, help="timed steps of the legit engine alone, and as many under attack (default 1000)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds alone and under attack, in turns (default 5)")
    parser.add_argument("--commands", type=int, default=32, help="commands per legit step (default 32)")
    parser.add_argument("--warmup", type=int, default=100, help="legit steps before timing (default 100)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--attacks", default="", help="only these attacks, comma-separated (default: every one)")
    parser.add_argument("--attacker", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if args.attacker:
        anyio.run(attacker, args.attacker, frozenset(filter(None, args.attacks.split(","))))
        return 0
    if args.steps < 1 or args.commands < 1 or args.warmup < 0 or not 1 <= args.rounds <= args.steps:
        parser.error("--steps and --commands must be positive, --rounds between 1 and --steps, --warmup not negative")
    unknown = sorted(set(filter(None, args.attacks.split(","))) - set(ATTACK_NAMES))
    if unknown:  # the attacker would run nothing and never say `attacking`
        parser.error(f"unknown attacks {unknown}; known: {', '.join(ATTACK_NAMES)}")
    kvledger = Path(sys.executable).parent / "kvledger"
    out(f"host at start: {load()}")
    out(core_build())
    with tempfile.TemporaryDirectory(prefix="kvl-hostile-bench-") as name:
        directory = Path(name)
        socket_path = str(directory / "kvledger.sock")
        credentials = directory / "credentials.toml"
        credentials.write_text(CREDENTIALS)
        credentials.chmod(0o600)
        command = [
            str(kvledger),
            "serve",
            "--socket",
            socket_path,
            "--log",
            str(directory / "log.sqlite"),
            "--http",
            "off",
            "--credentials",
            str(credentials),
        ] + [str(x) for option, value in BUDGET.items() for x in (option, value)]
        output = directory / "serve.log"
        env = {**os.environ, "KVLEDGER_DATA_DIR": str(directory)}
        with output.open("wb") as sink:
            server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            status = anyio.run(run, args, server, socket_path, directory)
        except BaseException:
            console.print(f"the benchmark failed; kvledger serve's last output:\n{server_output(output)}")
            raise
        finally:
            code = stop(server)
            out(f"sidecar exit code after SIGTERM: {code} ({'clean' if code == 0 else 'NOT clean'})")
            if server.poll() is None:
                server.kill()
                server.wait()
    return status


class Phases:
    """The legitimate engine's timed steps and the sidecar's CPU, alone and under attack."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {"alone": [], "attacked": []}
        self.wall = {"alone": 0.0, "attacked": 0.0}
        self.sidecar_cpu = {"alone": 0.0, "attacked": 0.0}
        self.attacker_cpu = 0.0

    async def run(self, name: str, legit: Legit, steps: int, server_pid: int, attacker_pid: int | None) -> None:
        cpu0, started = cpu_seconds(server_pid)[1], time.perf_counter()
        attacker0 = cpu_seconds(attacker_pid)[1] if attacker_pid is not None else None
        self.latencies[name] += await legit.steps(steps)
        self.wall[name] += time.perf_counter() - started
        cpu1 = cpu_seconds(server_pid)[1]
        if cpu0 is not None and cpu1 is not None:
            self.sidecar_cpu[name] += cpu1 - cpu0
        if attacker0 is not None and attacker_pid is not None:
            attacker1 = cpu_seconds(attacker_pid)[1]
            self.attacker_cpu += (attacker1 or attacker0) - attacker0


async def run(args: argparse.Namespace, server: subprocess.Popen[bytes], socket_path: str, directory: Path) -> int:
    await wait_ready(server, socket_path, OBSERVER_TOKEN)
    legit = Legit(socket_path, args.commands, args.seed)
    phases = Phases()
    per_round = [args.steps // args.rounds + (1 if index < args.steps % args.rounds else 0) for index in range(args.rounds)]
    async with legit.client:
        console.print(
            f"{args.warmup} warmup steps alone, then {args.rounds} rounds of {args.steps // args.rounds} timed steps "
            f"of {args.commands} commands alone (the attacker stopped) and as many under attack"
        )
        await legit.steps(args.warmup)
        gc.collect()
        rss_before = rss_mib(server.pid)
        attack = subprocess.Popen(
            [sys.executable, __file__, "--attacker", socket_path, "--attacks", args.attacks],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            text=True,
        )
        try:
            assert attack.stdout is not None
            with anyio.fail_after(START_TIMEOUT):
                line = await anyio.to_thread.run_sync(attack.stdout.readline)
            if line.strip() != "attacking":
                raise RuntimeError(f"the attacker said {line!r}, not `attacking`")
            peak = rss_before

            async def watch_rss() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, rss_mib(server.pid))
                    await anyio.sleep(0.1)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_rss)
                await anyio.sleep(2.0)  # every attack well under way
                for steps in per_round:
                    # Alone and under attack in turns, so the host's drift (these machines
                    # differ 3x from day to day, and minute to minute) falls on both alike.
                    attack.send_signal(signal.SIGSTOP)
                    await anyio.sleep(SETTLE)  # what the attacker had in flight is served
                    await phases.run("alone", legit, steps, server.pid, None)
                    attack.send_signal(signal.SIGCONT)
                    await anyio.sleep(RESUME)
                    await phases.run("attacked", legit, steps, server.pid, attack.pid)
                tg.cancel_scope.cancel()
            peak = max(peak, rss_mib(server.pid))
        finally:
            attack.send_signal(signal.SIGCONT)
            attack.send_signal(signal.SIGTERM)
            try:
                tally, _ = await anyio.to_thread.run_sync(lambda: attack.communicate(timeout=30))
            except subprocess.TimeoutExpired:
                attack.kill()
                tally = "(the attacker did not stop within 30 s)"
    print(tally, end="", flush=True)
    a50, a99, amax = figures(phases.latencies["alone"])
    h50, h99, hmax = figures(phases.latencies["attacked"])
    ratio = h99 / a99
    growth = peak - rss_before
    out(
        f"legit engine, {args.steps} steps of {args.commands} commands alone and {args.steps} under attack, "
        f"in {args.rounds} rounds of each (after {args.warmup} warmup steps)"
    )
    out(
        f"alone: p50 {a50:.2f} ms, p99 {a99:.2f} ms, max {amax:.2f} ms in {phases.wall['alone']:.2f} s; "
        f"sidecar CPU {phases.sidecar_cpu['alone']:.2f} s"
    )
    out(
        f"under attack: p50 {h50:.2f} ms, p99 {h99:.2f} ms, max {hmax:.2f} ms in {phases.wall['attacked']:.2f} s; "
        f"sidecar CPU {phases.sidecar_cpu['attacked']:.2f} s, attacker CPU {phases.attacker_cpu:.2f} s"
    )
    out(f"sidecar RSS {rss_before:.1f} MiB before the attack, peak {peak:.1f} MiB under attack")
    refused = legit.load.refused
    out(f"legit commands refused: {refused} (0 expected)")
    met = [h99 <= P99_RATIO_TARGET * a99, h99 <= P99_TARGET_MS, growth <= RSS_TARGET_MIB]
    out(
        f"targets: p99 under attack <= {P99_RATIO_TARGET:g}x alone: {'met' if met[0] else 'MISSED'}; "
        f"<= {P99_TARGET_MS:g} ms: {'met' if met[1] else 'MISSED'}; RSS growth <= {RSS_TARGET_MIB:g} MiB: "
        f"{'met' if met[2] else 'MISSED'}"
    )
    out(f"host at end: {load()}")
    out(f"p99 alone ms {a99:.2f}")
    out(f"p99 under attack ms {h99:.2f}")
    out(f"p99 ratio {ratio:.2f}")
    out(f"rss growth MiB {growth:.1f}")
    return 0 if refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
