"""The model runner: a persistent batch fed by delta StepPlans, flat inputs, forward, sample.

For each scheduled request the step computes tokens [num_computed, num_computed + num_new) of
`token_ids`; their KV goes to slots block_ids[pos // block_size] * block_size + pos % block_size.
A request samples when the step reaches the end of its `token_ids`; the sampled token is appended
here, so a decode needs no token ids from the Scheduler.

Where the CPU fast path serves (kernels/cpu/fast_path.py, None elsewhere), it is the one hook: a
step of decodes gets its inputs in C (DecodeBatch), its hidden states from the decode stack and
its greedy tokens from the fused head; every other step goes through the model and the sampler.

A step's inputs are numbers first (flat_step.py), then tensors: on the CPU, host tensors over
those numbers; on CUDA, persistent pinned buffers copied to persistent device buffers
(step_buffers.py). Once `capture_decode_graphs` ran, a step of decodes alone replays a CUDA
graph over those buffers, padded to the next captured batch size (graph_runner.py).

Stream ordering on CUDA (the Worker's two streams; the forward thread alone issues work):
- copy stream, first: KV swaps. It waits for the compute stream before it reads blocks to swap
  out (the last forward may still write them) or writes blocks swapped in (the last forward may
  still read them); the compute stream waits for the swaps (an event) before the forward.
- compute stream: block copies (copy-on-write), then the step.
- copy stream, second: the step's inputs into the device buffers, after waiting for the compute
  stream (the last forward read the same buffers); the compute stream waits for them (an event).
  The host waits for the previous step's input copies before rewriting the pinned staging.
  Every tensor that crosses the two streams is a persistent buffer (step buffers, KV cache,
  swap space), so record_stream has nothing to guard (step_buffers.py says why).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

from ...messages.step import StepPlan, StepResult
from ..runtime.config import EngineConfig
from ..runtime.step_trace import open_trace
from .block_tables import BlockTables
from .cached_request import CachedRequest
from .decode_batch import DecodeBatch
from .flat_step import FlatStep, flat_step, past_blocks
from .grammar_cache import GrammarCache
from .grammar_state import GrammarState
from .graph_runner import DecodeGraphs, graph_batch_sizes
from .kv_cache import KVCache
from .logprobs import PromptLogprobsTracker
from .models.llama import AttentionMetadata
from .sample_row import SampleRow
from .sampler import Sampler
from .step_buffers import StepBuffers
from .step_inputs import StepInputs
from .step_sampling import StepSampler
from .tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from ...kernels.cpu.fast_path import CpuFastPath


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model,
        kv: KVCache,
        device: torch.device,
        fast_path: CpuFastPath | None = None,
        tp: TensorParallel | None = None,
    ):
        """`fast_path`: prepared over this model and `kv` (CpuFastPath.prepare), or None. `tp`:
        the model's group; every rank runs the same plans and samples the same tokens."""
        self.config = config
        self.model = model
        self.fast_path = fast_path
        self.compute_logits = (
            model.compute_logits if fast_path is None else fast_path.compute_logits
        )
        # the LM head's own greedy pick: the fast path's fused head, or a tensor-parallel model's
        # gather of each rank's best token (no full logits); the single-device torch path has none
        greedy = model.greedy_tokens if tp is not None and tp.size > 1 else None
        self.greedy_tokens = greedy if fast_path is None else fast_path.greedy_tokens
        self.kv = kv
        self.kv_caches = kv.layers
        self.device = device
        self.block_size = config.block_size
        self.eos_token_ids = config.facts.eos_token_ids
        self.requests: dict[str, CachedRequest] = {}
        self.block_tables = BlockTables(max(1, config.max_num_seqs))
        self.decodes: DecodeBatch | None = None  # the last step, when all its requests decoded
        self.grown: list[tuple[int, CachedRequest]] = []  # (index in the step, request)
        if fast_path is None:
            self.sampler = Sampler(config.seed, device=device)
        else:
            self.sampler = Sampler(config.seed, fast_path.argmax_rows, device)
        self.step_sampler = StepSampler(self.sampler, self.compute_logits, self.greedy_tokens)
        self.prompt_logprobs = PromptLogprobsTracker()  # requests owing prompt logprobs
        self.grammars = GrammarCache(
            config.model,
            config.facts.vocab_size,
            self.eos_token_ids,
            config.structured_cache_size,
            config.structured_max_whitespace,
        )
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None  # step inputs, KV swaps
        self.compute_stream = torch.cuda.Stream(device) if cuda else None
        self.buffers = self._step_buffers() if cuda else None  # the CPU: host tensors per step
        self.decode_graphs: DecodeGraphs | None = None  # see capture_decode_graphs
        self.trace = open_trace(config.step_trace)  # a record per step with its phases' clock times

    def apply(self, plan: StepPlan) -> list[tuple[str, int]]:
        """Update the persistent batch; return the step's (request id, tokens to compute)."""
        for rid in plan.removed:
            self.forget(rid)
        scheduled, self.grown = [], []
        for update in plan.running:
            request = self.requests.get(update.request_id)
            if request is None:  # dropped when the step before (planned with this one) failed
                continue
            if update.new_block_ids:
                self.block_tables.write(request.row, request.num_blocks, update.new_block_ids)
                request.num_blocks += len(update.new_block_ids)
                self.grown.append((len(scheduled), request))
            scheduled.append((update.request_id, update.num_new_tokens))
        for new in plan.new:
            self.forget(new.request_id)  # re-sent after a preemption: a fresh start
            self.decodes = None
            stops = sorted(new.params.stop_token_set(self.eos_token_ids))
            row = self.block_tables.take_row()
            self.block_tables.write(row, 0, new.block_ids)
            token_ids = list(new.token_ids)
            sample_row = SampleRow(new.params, 0, 0, stops, token_ids)
            if new.params.structured is not None:  # its matcher, past the tokens it has
                compiled = self.grammars.get(new.params.structured)
                sample_row.grammar = GrammarState(compiled, token_ids[new.num_prompt_tokens :])
            self.requests[new.request_id] = CachedRequest(
                token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                row,
                len(new.block_ids),
                new,
                sample_row,
            )
            scheduled.append((new.request_id, new.num_new_tokens))
        return scheduled

    def forget(self, request_id: str) -> None:
        """Drop a request from the persistent batch (if there), freeing its block table row."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.block_tables.release(request.row, request.num_blocks)
            self.decodes = None

    def forget_all(self) -> None:
        self.requests.clear()
        self.decodes = None
        self.block_tables.clear()

    def prepare(self, scheduled: list[tuple[str, int]]) -> StepInputs:
        """Flat inputs for the step, vectorized over requests (flat_step.py), as host tensors
        or staged in the step buffers; a step of decodes alone through the fast path where it
        serves (_decode_inputs), or through a decode graph where one was captured."""
        last, self.decodes = self.decodes, None  # kept again only once this step is done
        if self.fast_path is not None:
            inputs = self._decode_inputs(scheduled, last)
            if inputs is not None:
                return inputs
        step = flat_step(scheduled, self.requests, self.block_tables, self.block_size)
        if self.buffers is None:
            tensors, graph = step.host_tensors(self.block_tables), None
        else:
            graph = self._graph_size(step)
            tensors = self.buffers.stage(step, graph)
        return StepInputs(
            *tensors, step.sample_ids, step.sample_rows, step.requests, step.sample_requests,
            decode_graph=graph,
        )  # fmt: skip

    def _graph_size(self, step: FlatStep) -> int | None:
        """The captured batch size that runs `step`, or None: it runs eagerly."""
        graphs = self.decode_graphs
        if graphs is None or not step.decodes_only or step.width > self.buffers.graph_width:
            return None
        return graphs.padded_size(len(step.requests))

    def _decode_inputs(self, scheduled, last: DecodeBatch | None) -> StepInputs | None:
        """prepare() for one token per request, through the fast path: the numbers in C
        (kernels/cpu/csrc/cpu_step_inputs.c: one call where numpy makes a dozen, each slow on
        the caches the last step streamed through), from the last step's (DecodeBatch) when it
        decoded the same requests; None for a step that is not decodes alone."""
        table = self.block_tables.table
        if last is not None and scheduled == last.scheduled:
            last.grew(self.grown)
            batch = last
        elif all(count == 1 for _, count in scheduled):
            reqs = [self.requests[rid] for rid, _ in scheduled]
            batch = DecodeBatch.of(scheduled, reqs, table.shape[1], self.fast_path)
        else:
            return None
        if table.shape[1] > batch.inputs.columns:  # the block tables grew a column
            batch.inputs = self.fast_path.decode_inputs(batch.numbers, table.shape[1])
        inputs = batch.inputs
        past = batch.fill(table, self.block_size)
        if past is not None:
            numbers = batch.numbers[past]
            request_id, end = batch.scheduled[past][0], int(numbers[0]) + 1
            raise past_blocks(request_id, end, int(numbers[1]), self.block_size)
        index = batch.sample_index
        meta = AttentionMetadata(
            inputs.slots, inputs.tables, inputs.seq_lens, inputs.query_start_loc
        )
        return StepInputs(
            inputs.input_ids, inputs.positions, meta,
            None if index is None else torch.tensor(index, dtype=torch.long),
            batch.sample_ids, batch.sample_rows, batch.requests,
            batch.requests if index is None else [batch.requests[i] for i in index], batch,
        )  # fmt: skip

    def _step_buffers(self) -> StepBuffers:
        config = self.config
        width = -(-(config.max_model_len or 0) // self.block_size)
        return StepBuffers(
            config.max_num_batched_tokens, config.max_num_seqs, self.block_tables,
            max(width, self.block_tables.table.shape[1]), self.device, self.copy_stream,
        )  # fmt: skip

    def capture_decode_graphs(self, eager_replay: bool = False) -> list[int]:
        """Capture the decode graphs (graph_runner.py), which then serve every step of decodes
        alone: the batch sizes captured. None are ([]) with config.enforce_eager, with the CPU
        fast path, or on a device without CUDA graphs unless `eager_replay`: graphs that run
        the model on each replay instead of recording it (the same buffers, padding and
        slicing; the CPU tests' path). Call once, at start, after the KV cache exists."""
        if self.config.enforce_eager or self.fast_path is not None:
            return []
        if self.device.type != "cuda" and not eager_replay:
            return []
        if self.buffers is None:
            self.buffers = self._step_buffers()
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        graphs = DecodeGraphs(self.model, self.kv_caches, self.buffers, sizes, not eager_replay)
        with torch.inference_mode(), self._on_compute_stream():
            graphs.capture()
        self.decode_graphs = graphs
        return sizes

    def _on_compute_stream(self):
        if self.compute_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.compute_stream)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step (in inference mode: the Worker's forward thread is in it throughout, as
        entering and leaving it every step is slow on the cold caches a step leaves)."""
        if torch.is_inference_mode_enabled():
            return self._execute(plan)
        with torch.inference_mode():
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        with self._on_compute_stream():  # the forward below waits for these on this stream
            self.kv.swap(plan.swap_out, plan.swap_in, self.copy_stream)
            self.kv.copy(plan.copies)
        scheduled = self.apply(plan)
        self.prompt_logprobs.track(plan.new)
        if not scheduled:
            return StepResult(plan.epoch, plan.step_id, [], [])
        with self._on_compute_stream():
            inputs = self.prepare(scheduled)
            prepared = self._clock()
            hidden = self._forward(inputs)
            forwarded = self._clock()
            tokens, token_tensor, logprobs, logits_done = self.step_sampler.sample(
                hidden, inputs, forwarded, self._clock
            )
            prompt_logprobs = self.prompt_logprobs.compute(
                self.compute_logits, hidden, scheduled, self.requests
            )
        for request, (_, count) in zip(inputs.requests, scheduled):
            request.num_computed += count
        for request, token in zip(inputs.sample_requests, tokens):
            request.token_ids.append(token)
        if inputs.decodes is not None and inputs.decodes.sample_index is None:
            if token_tensor is None:
                token_tensor = torch.tensor(tokens, dtype=torch.long)
            inputs.decodes.advance(token_tensor)
            self.decodes = inputs.decodes
        finished = time.perf_counter()
        if self.trace is not None:
            self._write_trace(plan, scheduled, inputs, started, prepared, forwarded, logits_done)
        return StepResult(
            plan.epoch,
            plan.step_id,
            inputs.sample_ids,
            tokens,
            forward_s=finished - started,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states: its decode graph's, or the fast path's decode stack where
        it serves the step, else the model's (the same numbers)."""
        if inputs.decode_graph is not None:  # its first rows: the step's own
            return self.decode_graphs.replay(inputs.decode_graph)[: len(inputs.requests)]
        args = (inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        hidden = None if self.fast_path is None else self.fast_path.forward(*args)
        return self.model(*args) if hidden is None else hidden

    def _clock(self) -> float | None:
        """perf_counter when tracing (after the device caught up), else None."""
        if self.trace is None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _write_trace(self, plan, scheduled, inputs, started, prepared, forwarded, logits_done):
        record = {
            "step": plan.step_id,
            "seqs": len(scheduled),
            "tokens": int(inputs.input_ids.shape[0]),
            "samples": len(inputs.sample_ids),
            "start": started,
            "prepared": prepared,
            "forwarded": forwarded,
            "logits": logits_done,
            "end": time.perf_counter(),
        }
        self.trace.record(record)
