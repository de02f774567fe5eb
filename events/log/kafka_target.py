"""Where a Kafka log lives: its kafka:// URL, and the topic it needs (one partition).

kafka://HOST:PORT[,HOST:PORT...]/TOPIC[?state=...&replication_factor=N&fetch_wait_ms=N&request_timeout_ms=N]
* state: the SQL state store (a path or a SQL URL) for checkpoints, projections and snapshots;
  default: a SQLite file under the data directory, named after the brokers and the topic.
* replication_factor: used only when kvledger creates the topic (default 3).
* fetch_wait_ms: how long a fetch waits on the broker for new records (default 100).
* request_timeout_ms: how long one request waits for the broker before it fails (default 15000);
  a call that waits on the broker (an append, a catch-up) gives up after twice that, with
  LogUnavailable: how soon an unreachable broker shows as a failed append and on /readyz.
"""

from __future__ import annotations

import re
import urllib.parse

import anyio
import msgspec
import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from events.log._contract import LogError, LogUnavailable
from events.log._urls import data_dir, is_kafka, mask

log = structlog.get_logger("kvledger.log")

DEFAULT_PORT = 9092
DEFAULT_REPLICATION = 3
DEFAULT_FETCH_WAIT_MS = 100
REQUEST_TIMEOUT_MS = 15_000
"""The default request_timeout_ms."""
CALL_TIMEOUT_S = 2 * REQUEST_TIMEOUT_MS / 1000
"""How long a call waits for the broker before LogUnavailable, by default (KafkaTarget.call_timeout_s)."""
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_QUERY_KEYS = {"state", "replication_factor", "fetch_wait_ms", "request_timeout_ms"}


class KafkaTarget(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed kafka:// URL."""

    url: str
    bootstrap: list[str]
    topic: str
    state_url: str
    replication_factor: int = DEFAULT_REPLICATION
    fetch_wait_ms: int = DEFAULT_FETCH_WAIT_MS
    request_timeout_ms: int = REQUEST_TIMEOUT_MS

    @property
    def call_timeout_s(self) -> float:
        """How long a call waits for the broker before LogUnavailable."""
        return 2 * self.request_timeout_ms / 1000


def parse_kafka_url(url: str) -> KafkaTarget:
    """Parse kafka://HOST:PORT[,HOST:PORT...]/TOPIC[?state=...&replication_factor=N&fetch_wait_ms=N&request_timeout_ms=N]."""
    shown = mask(url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "kafka":
        raise ValueError(f"not a kafka:// URL: {shown!r}")
    if "@" in parts.netloc:
        raise ValueError(f"{shown}: credentials in a kafka:// URL are not supported yet")
    bootstrap = []
    for host in filter(None, parts.netloc.split(",")):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", str(DEFAULT_PORT))
        if not name or not port.isdigit():
            raise ValueError(f"{shown}: {host!r} is not HOST:PORT")
        bootstrap.append(f"{name}:{port}")
    topic = parts.path.strip("/")
    if not bootstrap or not _TOPIC.match(topic):
        raise ValueError(f"{shown}: a Kafka log URL is kafka://HOST:PORT/TOPIC (topic: letters, digits, '.', '_', '-')")
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - _QUERY_KEYS)
    if unknown:
        raise ValueError(f"{shown}: unknown parameter(s) {', '.join(unknown)} (known: {', '.join(sorted(_QUERY_KEYS))})")
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", parts.netloc)
    state = query.get("state", [str(data_dir() / "kafka" / f"{slug}-{topic}.sqlite")])[-1]
    if is_kafka(state):
        raise ValueError(f"{shown}: the state store must be a SQL database or a file, not {state!r}")
    try:
        replication = int(query.get("replication_factor", [DEFAULT_REPLICATION])[-1])
        fetch_wait = int(query.get("fetch_wait_ms", [DEFAULT_FETCH_WAIT_MS])[-1])
        request_timeout = int(query.get("request_timeout_ms", [REQUEST_TIMEOUT_MS])[-1])
    except ValueError:
        raise ValueError(f"{shown}: replication_factor, fetch_wait_ms and request_timeout_ms are integers") from None
    if request_timeout < 100:
        raise ValueError(f"{shown}: request_timeout_ms {request_timeout} is below 100")
    return KafkaTarget(
        url=shown,
        bootstrap=bootstrap,
        topic=topic,
        state_url=state,
        replication_factor=replication,
        fetch_wait_ms=fetch_wait,
        request_timeout_ms=request_timeout,
    )


async def probe(target: KafkaTarget) -> None:
    """Raise LogUnavailable (one line) unless a broker of `target` answers."""
    admin = AIOKafkaAdminClient(bootstrap_servers=target.bootstrap, request_timeout_ms=target.request_timeout_ms)
    try:
        with anyio.fail_after(target.call_timeout_s):
            await admin.start()
    except (KafkaError, OSError, TimeoutError) as error:
        raise LogUnavailable(f"cannot reach log {target.url}: {one_line(error)}") from error
    finally:
        await admin.close()


async def ensure_topic(target: KafkaTarget) -> None:
    """Create the topic with one partition if it is missing; refuse one with several.

    Existence is checked by listing topics: a metadata request for a missing topic creates it
    on brokers that auto-create topics, with their default partition count."""
    admin = AIOKafkaAdminClient(bootstrap_servers=target.bootstrap, request_timeout_ms=target.request_timeout_ms)
    try:
        with anyio.fail_after(target.call_timeout_s):
            await admin.start()
            if target.topic not in await admin.list_topics():
                response = await admin.create_topics(
                    [NewTopic(target.topic, num_partitions=1, replication_factor=target.replication_factor)]
                )
                for _topic, code, message in response.topic_errors:
                    if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS (another opener won the race)
                        raise LogUnavailable(
                            f"cannot create topic {target.topic!r} on {target.url}: {message or 'error code ' + str(code)}"
                            + (" (a single broker needs ?replication_factor=1)" if code == 38 else "")
                        )
                log.info("kafka_topic_created", topic=target.topic, replication_factor=target.replication_factor)
            [described] = await admin.describe_topics([target.topic])
            partitions = len(described["partitions"])
    except (KafkaError, OSError, TimeoutError) as error:
        raise LogUnavailable(f"cannot open log {target.url}: {one_line(error)}") from error
    finally:
        await admin.close()
    if partitions != 1:
        raise LogError(
            f"topic {target.topic!r} on {target.url} has {partitions} partitions; the kvledger log needs exactly one "
            "(its global sequence is the partition's order)"
        )


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
