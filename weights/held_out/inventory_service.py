# Written by hand for the demo checkpoint's evaluation (scripts/train_demo.py): ordinary Python
# that the model never trained on and that is in no installed package. Do not use it for
# training, and do not change it without re-measuring both models (docs/benchmarks.md).
"""A small inventory service: data classes, a JSON store, an async HTTP client, a CLI, and a
load generator that exercises it."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit


class InventoryError(Exception):
    """Raised when a request cannot be satisfied by the current stock."""


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    price_cents: int
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.sku:
            raise ValueError("a product needs a SKU")
        if self.price_cents < 0:
            raise ValueError(f"price of {self.sku} must not be negative")

    @property
    def price(self) -> float:
        return self.price_cents / 100


@dataclass
class StockLine:
    product: Product
    quantity: int = 0
    reserved: int = 0

    @property
    def available(self) -> int:
        return self.quantity - self.reserved


@dataclass
class Order:
    order_id: str
    lines: dict[str, int] = field(default_factory=dict)
    created: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    status: str = "open"

    def total_items(self) -> int:
        return sum(self.lines.values())


class Inventory:
    """Stock levels per SKU, with reservations for open orders."""

    def __init__(self) -> None:
        self._stock: dict[str, StockLine] = {}
        self._orders: dict[str, Order] = {}
        self._history: deque[tuple[str, str, int]] = deque(maxlen=1000)

    def add_product(self, product: Product, quantity: int = 0) -> None:
        if product.sku in self._stock:
            raise InventoryError(f"{product.sku} is already in the catalogue")
        self._stock[product.sku] = StockLine(product, quantity)
        self._history.append(("add", product.sku, quantity))

    def restock(self, sku: str, quantity: int) -> int:
        line = self._line(sku)
        if quantity <= 0:
            raise ValueError("restock quantity must be positive")
        line.quantity += quantity
        self._history.append(("restock", sku, quantity))
        return line.quantity

    def reserve(self, order: Order) -> None:
        missing = {
            sku: count - self._line(sku).available
            for sku, count in order.lines.items()
            if self._line(sku).available < count
        }
        if missing:
            details = ", ".join(f"{sku} short by {n}" for sku, n in sorted(missing.items()))
            raise InventoryError(f"cannot reserve order {order.order_id}: {details}")
        for sku, count in order.lines.items():
            self._line(sku).reserved += count
        self._orders[order.order_id] = order
        order.status = "reserved"

    def ship(self, order_id: str) -> Order:
        order = self._orders.pop(order_id, None)
        if order is None:
            raise KeyError(order_id)
        for sku, count in order.lines.items():
            line = self._line(sku)
            line.reserved -= count
            line.quantity -= count
            self._history.append(("ship", sku, count))
        order.status = "shipped"
        return order

    def cancel(self, order_id: str) -> None:
        order = self._orders.pop(order_id)
        for sku, count in order.lines.items():
            self._line(sku).reserved -= count
        order.status = "cancelled"

    def value(self) -> int:
        return sum(line.quantity * line.product.price_cents for line in self._stock.values())

    def low_stock(self, threshold: int = 5) -> list[str]:
        return sorted(sku for sku, line in self._stock.items() if line.available < threshold)

    def by_tag(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = defaultdict(list)
        for sku, line in self._stock.items():
            for tag in line.product.tags:
                groups[tag].append(sku)
        return {tag: sorted(skus) for tag, skus in groups.items()}

    def __iter__(self) -> Iterator[StockLine]:
        return iter(self._stock.values())

    def __len__(self) -> int:
        return len(self._stock)

    def _line(self, sku: str) -> StockLine:
        try:
            return self._stock[sku]
        except KeyError:
            raise InventoryError(f"unknown SKU {sku!r}") from None


class JsonStore:
    """Saves and loads an inventory as one JSON document, written atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def save(self, inventory: Inventory) -> None:
        payload = {
            "saved_at": datetime.now(timezone.utc).isoformat(),
            "stock": [
                {"product": asdict(line.product), "quantity": line.quantity} for line in inventory
            ],
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(self.path)

    def load(self) -> Inventory:
        inventory = Inventory()
        if not self.path.exists():
            return inventory
        payload = json.loads(self.path.read_text())
        for item in payload.get("stock", []):
            data = item["product"]
            product = Product(data["sku"], data["name"], data["price_cents"], tuple(data["tags"]))
            inventory.add_product(product, item["quantity"])
        return inventory


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body.decode("utf-8"))


class HttpClient:
    """A minimal HTTP/1.1 client over asyncio streams, one connection per request."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError("only plain http is supported")
        self.host = parts.hostname or "localhost"
        self.port = parts.port or 80
        self.timeout = timeout

    async def request(self, method: str, path: str, body: dict | None = None) -> Response:
        data = json.dumps(body).encode() if body is not None else b""
        head = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Connection: close",
            f"Content-Length: {len(data)}",
        ]
        if body is not None:
            head.append("Content-Type: application/json")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), self.timeout
        )
        try:
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), self.timeout)
        finally:
            writer.close()
            await writer.wait_closed()
        return parse_response(raw)

    async def get(self, path: str) -> Response:
        return await self.request("GET", path)

    async def post(self, path: str, body: dict) -> Response:
        return await self.request("POST", path, body)


def parse_response(raw: bytes) -> Response:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = lines[0].split(" ", 2)
    if not version.startswith("HTTP/"):
        raise ValueError(f"not an HTTP response: {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Response(int(status), headers, body)


@dataclass
class LoadReport:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict[str, float]:
        if not self.latencies:
            return {"requests": 0, "errors": self.errors}
        ordered = sorted(self.latencies)
        return {
            "requests": len(ordered),
            "errors": self.errors,
            "mean_ms": statistics.mean(ordered) * 1000,
            "p50_ms": percentile(ordered, 50) * 1000,
            "p99_ms": percentile(ordered, 99) * 1000,
        }


def percentile(ordered: list[float], pct: float) -> float:
    if not ordered:
        raise ValueError("percentile of an empty list")
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def generate_load(client: HttpClient, skus: list[str], requests: int, concurrency: int):
    report = LoadReport()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            sku = random.choice(skus)
            start = time.perf_counter()
            try:
                if i % 4 == 0:
                    response = await client.post("/orders", {"lines": {sku: 1}})
                else:
                    response = await client.get(f"/stock/{sku}")
                if response.status >= 400:
                    report.errors += 1
            except (OSError, asyncio.TimeoutError):
                report.errors += 1
            else:
                report.latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return report


def binary_search(items: list[int], target: int) -> int:
    """The index of target in the sorted list, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


def knapsack(weights: list[int], values: list[int], capacity: int) -> int:
    best = [0] * (capacity + 1)
    for weight, value in zip(weights, values):
        for room in range(capacity, weight - 1, -1):
            best[room] = max(best[room], best[room - weight] + value)
    return best[capacity]


def topological_order(graph: dict[str, list[str]]) -> list[str]:
    indegree = {node: 0 for node in graph}
    for targets in graph.values():
        for target in targets:
            indegree[target] = indegree.get(target, 0) + 1
    ready = deque(sorted(node for node, count in indegree.items() if count == 0))
    order = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for target in graph.get(node, []):
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
    if len(order) != len(indegree):
        raise ValueError("the graph has a cycle")
    return order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Manage a small inventory file.")
    parser.add_argument("--store", type=Path, default=Path("inventory.json"))
    commands = parser.add_subparsers(dest="command", required=True)
    add = commands.add_parser("add", help="add a product")
    add.add_argument("sku")
    add.add_argument("name")
    add.add_argument("price", type=float)
    add.add_argument("--quantity", type=int, default=0)
    add.add_argument("--tag", action="append", default=[])
    restock = commands.add_parser("restock", help="add units of a product")
    restock.add_argument("sku")
    restock.add_argument("quantity", type=int)
    commands.add_parser("report", help="print stock and value")
    load = commands.add_parser("load", help="send requests to a running server")
    load.add_argument("url")
    load.add_argument("--requests", type=int, default=100)
    load.add_argument("--concurrency", type=int, default=8)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    store = JsonStore(args.store)
    inventory = store.load()
    try:
        if args.command == "add":
            price = round(args.price * 100)
            inventory.add_product(
                Product(args.sku, args.name, price, tuple(args.tag)), args.quantity
            )
        elif args.command == "restock":
            print(f"{args.sku}: {inventory.restock(args.sku, args.quantity)} in stock")
        elif args.command == "report":
            for line in sorted(inventory, key=lambda line: line.product.sku):
                print(f"{line.product.sku:10} {line.product.name:30} {line.available:6d}")
            print(f"total value: {inventory.value() / 100:.2f}")
            low = inventory.low_stock()
            if low:
                print("low stock: " + ", ".join(low))
            return 0
        elif args.command == "load":
            skus = [line.product.sku for line in inventory]
            if not skus:
                print("the inventory is empty", file=sys.stderr)
                return 1
            client = HttpClient(args.url)
            report = asyncio.run(generate_load(client, skus, args.requests, args.concurrency))
            print(json.dumps(report.summary(), indent=2))
            return 0
    except InventoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store.save(inventory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
