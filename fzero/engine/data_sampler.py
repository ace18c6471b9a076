"""DeepSpeed 0.19.8's curriculum data sampler `DeepSpeedDataSampler` (after Megatron-LM's; `fzero.deepspeed`
re-exports it at DeepSpeed's path, `deepspeed.runtime.data_pipeline.data_sampling.data_sampler`), the same batch
indices step by step. `engine.deepspeed_io` builds it (`fzero.engine.dataloader`) where curriculum data sampling is
enabled. It needs NumPy (an optional dependency of fzero: this module imports it, `import fzero` does not).

Per global batch (`micro_batch * world * gradient_accumulation_steps` samples) rank 0 advances every metric's
`CurriculumScheduler` by one step (`curriculum_step`, counted by the sampler itself); when a difficulty changed it
writes a new data cluster (the samples newly within the difficulty, from the DataAnalyzer's `index_to_sample` /
`index_to_metric` files, shuffled with `numpy.random.default_rng(data_efficiency.seed)`) to
`data_cluster_path/cluster_<metric><difficulty>.{bin,idx}`; it then draws how many samples each cluster gives in
proportion to their sizes, takes them in order (a cluster exhausted is reshuffled and started again), shuffles the
batch, and broadcasts it to the ranks, each yielding its contiguous share of every `micro_batch * world` slice.

Differences from DeepSpeed's, on purpose: the ranks receive the batch through the engine's mesh (a callable
`broadcast`; none where one process holds every rank); `state_dict()` is JSON values and holds the sampler's own
generator's state (DeepSpeed saves NumPy's *global* generator, which the sampler does not draw from, so its resumed
clusters and batches differ from an uninterrupted run's; fzero's are the same); the index files are read without
pickle (`indexed_dataset`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..config.data_keys import (
    CURRICULUM_LEARNING,
    CURRICULUM_LEARNING_BATCH,
    CURRICULUM_LEARNING_CLUSTER_PATH,
    CURRICULUM_LEARNING_CLUSTER_PREFIX,
    CURRICULUM_LEARNING_CONSUMED_SAMPLES,
    CURRICULUM_LEARNING_CURRENT_DIFFICULTIES,
    CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION,
    CURRICULUM_LEARNING_DATA_CLUSTER_PATHS,
    CURRICULUM_LEARNING_ENABLED,
    CURRICULUM_LEARNING_MAX_DIFFICULTY,
    CURRICULUM_LEARNING_METRIC_PATH,
    CURRICULUM_LEARNING_METRICS,
    CURRICULUM_LEARNING_NP_RNG_STATE,
    CURRICULUM_LEARNING_PERCENTILE_BASED,
    CURRICULUM_LEARNING_SAMPLE_PATH,
    CURRICULUM_LEARNING_SINGLE_CLUSTER,
    CURRICULUM_LEARNING_STEP,
    CURRICULUM_LEARNING_VALUE_BASED,
    DATA_EFFICIENCY_SEED,
    DATA_SAMPLING,
    DATA_SAMPLING_NUM_EPOCHS,
)
from .curriculum_scheduler import CurriculumScheduler
from .indexed_dataset import (
    MMapIndexedDataset,
    close_mmap_dataset_builder,
    create_mmap_dataset_builder,
    find_fit_int_dtype,
)

__all__ = ["DeepSpeedDataSampler"]

Broadcast = Callable[[torch.Tensor], torch.Tensor]


class DeepSpeedDataSampler:
    """DeepSpeed's curriculum batch sampler (see the module docstring); iterate it for each micro-batch's indices.

    Args:
      data_efficiency_config: the checked `data_efficiency` block (`fzero.config.data_efficiency`).
      one_epoch_total_samples: the data set's length.
      micro_batch_size, data_parallel_rank, data_parallel_size, gradient_accumulation_steps, global_rank: DeepSpeed's.
      data_parallel_group: DeepSpeed's argument, unused (`broadcast` replaces it).
      drop_last: drop a last micro-batch slice smaller than `micro_batch * world`.
      broadcast: rank 0's tensor on every rank (the mesh's); None where one process runs every rank.
    """

    def __init__(
        self,
        data_efficiency_config: Mapping[str, Any],
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_parallel_group: Any,
        gradient_accumulation_steps: int,
        global_rank: int,
        drop_last: bool = True,
        broadcast: Broadcast | None = None,
    ) -> None:
        self.data_efficiency_config = data_efficiency_config
        sampling = data_efficiency_config[DATA_SAMPLING]
        curriculum = sampling[CURRICULUM_LEARNING]
        self.one_epoch_total_samples = one_epoch_total_samples
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples)
        self.total_samples = one_epoch_total_samples * sampling[DATA_SAMPLING_NUM_EPOCHS]
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.global_rank = global_rank
        self.drop_last = drop_last
        self._broadcast = broadcast
        self.np_rng = np.random.default_rng(data_efficiency_config[DATA_EFFICIENCY_SEED])
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.enabled = bool(curriculum[CURRICULUM_LEARNING_ENABLED])
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self.data_cluster_paths: list[str] = []
        self.data_cluster_current_position: list[int] = []
        self.curriculum_schedulers: dict[str, CurriculumScheduler] = {}
        self.curriculum_index_to_sample: dict[str, MMapIndexedDataset] = {}
        self.curriculum_index_to_metric: dict[str, MMapIndexedDataset] = {}
        self.difficulty_type: dict[str, str] = {}
        self.clustering_type: dict[str, str] = {}
        self.data_1epoch_size: int | None = None
        self.data_clusters: list[MMapIndexedDataset] = []
        self.data_cluster_sizes: list[int] = []
        if self.total_samples <= 0:
            raise ValueError(f"no sample to consume: {self.total_samples} (an empty data set?)")
        if micro_batch_size <= 0 or data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"DeepSpeedDataSampler: micro_batch_size {micro_batch_size}, data_parallel_rank {data_parallel_rank} "
                f"of data_parallel_size {data_parallel_size}: expected positive sizes and a rank below the size"
            )
        if not self.enabled:
            return
        self.cluster_root = curriculum[CURRICULUM_LEARNING_CLUSTER_PATH]
        if global_rank == 0:
            os.makedirs(self.cluster_root, exist_ok=True)
        metrics = curriculum[CURRICULUM_LEARNING_METRICS]
        base = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
        for metric, block in metrics.items():
            self.curriculum_schedulers[metric] = CurriculumScheduler(block, f"{base}.{metric}")
            self.difficulty_type[metric] = block["difficulty_type"]
            self.clustering_type[metric] = block["clustering_type"]
            if global_rank == 0 and self.clustering_type[metric] != CURRICULUM_LEARNING_SINGLE_CLUSTER:
                self.curriculum_index_to_sample[metric] = MMapIndexedDataset(block[CURRICULUM_LEARNING_SAMPLE_PATH])
                if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
                    self.curriculum_index_to_metric[metric] = MMapIndexedDataset(block[CURRICULUM_LEARNING_METRIC_PATH])

    def __len__(self) -> int:
        return self.total_samples

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], Any]]) -> None:
        """The function of the step of each `custom` metric's schedule, by metric name."""
        for metric, scheduler in self.curriculum_schedulers.items():
            if metric in schedule_func_dict:
                scheduler.set_custom_get_difficulty(schedule_func_dict[metric])

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's `[start, end)` of a micro-batch slice of `batch_len` (default `micro_batch * world`)."""
        batch_len = batch_len or self.micro_batch_times_data_parallel_size

        def start(r: int) -> int:
            return round(r * batch_len / self.data_parallel_size)

        return start(self.data_parallel_rank), start(self.data_parallel_rank + 1)

    # --------------------------------------------------------------------------------------- clusters (rank 0)
    def get_sample_based_on_metric_value(self, metric: str, value_start: float, value_end: float) -> Any:
        new_samples = None
        values, samples = self.curriculum_index_to_metric[metric], self.curriculum_index_to_sample[metric]
        for row in range(len(samples)):
            value = values[row][0]  # (one metric value per row)
            if value_start < value <= value_end:
                rows = np.copy(samples[row])
                new_samples = rows if new_samples is None else np.concatenate((new_samples, rows), axis=None)
        return new_samples

    def get_sample_based_on_metric_percentile(self, metric: str, percentile_start: Any, percentile_end: Any) -> Any:
        new_samples = None
        samples = self.curriculum_index_to_sample[metric]
        if self.data_1epoch_size is None:
            self.data_1epoch_size = sum(len(samples[row]) for row in range(len(samples)))
        curriculum = self.data_efficiency_config[DATA_SAMPLING][CURRICULUM_LEARNING]
        max_percentile = curriculum[CURRICULUM_LEARNING_METRICS][metric][CURRICULUM_LEARNING_MAX_DIFFICULTY]
        per_percentile = self.data_1epoch_size // max_percentile
        start_count, end_count = per_percentile * percentile_start, per_percentile * percentile_end
        if percentile_end == max_percentile:
            end_count = self.data_1epoch_size
        count = 0
        for row in range(len(samples)):
            size = len(samples[row])
            if count + size > start_count:
                row_start = max(0, start_count - count)
                row_end = size if count + size <= end_count else end_count - count
                rows = np.copy(samples[row][int(row_start) : int(row_end)])
                new_samples = rows if new_samples is None else np.concatenate((new_samples, rows), axis=None)
            count += size
            if count >= end_count:
                break
        return new_samples

    def _metric_cluster(self, metric: str, start: Any, end: Any) -> Any:
        if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
            return self.get_sample_based_on_metric_value(metric, start, end)
        return self.get_sample_based_on_metric_percentile(metric, start, end)

    def get_new_cluster(self, previous_difficulties: Mapping[str, Any]) -> None:
        name = CURRICULUM_LEARNING_CLUSTER_PREFIX
        for metric in self.curriculum_schedulers:
            name = f"{name}_{metric}{self.current_difficulties[metric]}"
        path = f"{self.cluster_root}/{name}"
        written = 0
        if self.global_rank == 0:
            new_cluster: Any = None
            clustered = sum(t != CURRICULUM_LEARNING_SINGLE_CLUSTER for t in self.clustering_type.values())
            if clustered > 1:  # every sample within all the difficulties, less those of earlier clusters
                for metric in self.curriculum_schedulers:
                    if self.clustering_type[metric] == CURRICULUM_LEARNING_SINGLE_CLUSTER:
                        part = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
                    else:
                        low = float("-inf") if self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED else 0
                        part = self._metric_cluster(metric, low, self.current_difficulties[metric])
                    new_cluster = part if new_cluster is None else np.intersect1d(new_cluster, part, assume_unique=True)
                for cluster in self.data_clusters:
                    new_cluster = np.setdiff1d(new_cluster, cluster[0], assume_unique=True)
            else:
                if not self.data_clusters:
                    new_cluster = np.arange(0, self.one_epoch_total_samples, 1, dtype=self.index_dtype)
                for metric in self.curriculum_schedulers:
                    if self.clustering_type[metric] != CURRICULUM_LEARNING_SINGLE_CLUSTER:
                        new_cluster = self._metric_cluster(
                            metric, previous_difficulties[metric], self.current_difficulties[metric]
                        )
            if new_cluster is not None and len(new_cluster) > 0:
                self.np_rng.shuffle(new_cluster)
                builder = create_mmap_dataset_builder(path, self.index_dtype)
                builder.add_item_numpy(new_cluster)
                close_mmap_dataset_builder(builder, path)
                self.data_clusters.append(MMapIndexedDataset(path))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
                written = 1
        # (DeepSpeed: a barrier, then every rank looks for the file; here rank 0 says whether it wrote one)
        if self._broadcast is not None:
            written = int(self._broadcast(torch.tensor([written], dtype=torch.long)).item())
        if written:
            self.data_cluster_paths.append(name)
            self.data_cluster_current_position.append(0)

    def sample_from_clusters(self) -> Any:
        total = sum(self.data_cluster_sizes)
        weights = [x / total for x in self.data_cluster_sizes]
        samples = self.np_rng.choice(len(self.data_clusters), self.global_batch_size, replace=True, p=weights)
        return np.bincount(samples, minlength=len(self.data_clusters))

    def reshuffle_clusters(self, cidx: int) -> None:
        path = f"{self.cluster_root}/{self.data_cluster_paths[cidx]}"
        cluster = np.copy(self.data_clusters[cidx][0])
        self.np_rng.shuffle(cluster)
        builder = create_mmap_dataset_builder(path, self.index_dtype)
        builder.add_item_numpy(cluster)
        close_mmap_dataset_builder(builder, path)
        self.data_clusters[cidx] = MMapIndexedDataset(path)

    def get_sample_from_cluster(self, cidx: int, num_samples: int) -> list[int]:
        start = self.data_cluster_current_position[cidx]
        samples = [int(s) for s in self.data_clusters[cidx][0][start : start + num_samples]]
        self.data_cluster_current_position[cidx] += num_samples
        if len(samples) < num_samples:
            remaining = num_samples - len(samples)
            self.reshuffle_clusters(cidx)
            samples += [int(s) for s in self.data_clusters[cidx][0][:remaining]]
            self.data_cluster_current_position[cidx] = remaining
        return samples

    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and draw the next global batch (`self.batch`), as DeepSpeed's."""
        if not self.enabled:
            return
        self.curriculum_step += 1
        new_cluster = False
        previous: dict[str, Any] = {}
        for metric, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)
            if metric not in self.current_difficulties or difficulty != self.current_difficulties[metric]:
                new_cluster = True
            if metric in self.current_difficulties:
                previous[metric] = self.current_difficulties[metric]
            elif self.difficulty_type[metric] == CURRICULUM_LEARNING_VALUE_BASED:
                previous[metric] = float("-inf")
            elif self.difficulty_type[metric] == CURRICULUM_LEARNING_PERCENTILE_BASED:
                previous[metric] = 0
            self.current_difficulties[metric] = difficulty
        if new_cluster:
            self.get_new_cluster(previous)
        batch = torch.full((self.global_batch_size,), -1, dtype=torch.long)
        if self.global_rank == 0:
            counts = self.sample_from_clusters()
            drawn: list[int] = []
            for cidx in range(len(counts)):
                drawn += self.get_sample_from_cluster(cidx, int(counts[cidx]))
            self.np_rng.shuffle(drawn)
            batch[: len(drawn)] = torch.tensor(drawn, dtype=torch.long)
        if self._broadcast is not None:
            batch = self._broadcast(batch)
        self.batch = batch[batch != -1].tolist()  # (-1 fills a short batch, as in DeepSpeed)

    def __iter__(self) -> Any:
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
                if not self.batch:  # (curriculum learning disabled: DeepSpeed's would loop forever)
                    return
            current = self.batch[: self.micro_batch_times_data_parallel_size]
            self.batch = self.batch[self.micro_batch_times_data_parallel_size :]
            if len(current) == self.micro_batch_times_data_parallel_size or (current and not self.drop_last):
                start, end = self.get_start_end_idx(len(current))
                yield current[start:end]
                self.consumed_samples += len(current)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as JSON values (see the module docstring)."""
        return {
            CURRICULUM_LEARNING_BATCH: list(self.batch),
            CURRICULUM_LEARNING_CONSUMED_SAMPLES: self.consumed_samples,
            CURRICULUM_LEARNING_STEP: self.curriculum_step,
            CURRICULUM_LEARNING_CURRENT_DIFFICULTIES: dict(self.current_difficulties),
            CURRICULUM_LEARNING_DATA_CLUSTER_PATHS: list(self.data_cluster_paths),
            CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION: list(self.data_cluster_current_position),
            CURRICULUM_LEARNING_NP_RNG_STATE: self.np_rng.bit_generator.state,
            "curriculum_schedulers": {m: s.state_dict() for m, s in self.curriculum_schedulers.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s state; rank 0 reopens the data clusters it names under `data_cluster_path`.

        Raises:
          ValueError: the state is not this sampler's (another generator, or another metric's schedule).
        """
        self.batch = list(state_dict[CURRICULUM_LEARNING_BATCH])
        self.consumed_samples = state_dict[CURRICULUM_LEARNING_CONSUMED_SAMPLES]
        self.curriculum_step = state_dict[CURRICULUM_LEARNING_STEP]
        self.current_difficulties = dict(state_dict[CURRICULUM_LEARNING_CURRENT_DIFFICULTIES])
        # (DeepSpeed's checkpoints before its relative paths stored absolute ones: the file name is kept)
        self.data_cluster_paths = [p.split("/")[-1] for p in state_dict[CURRICULUM_LEARNING_DATA_CLUSTER_PATHS]]
        self.data_cluster_current_position = list(state_dict[CURRICULUM_LEARNING_DATA_CLUSTER_CURRENT_POSITION])
        rng = state_dict[CURRICULUM_LEARNING_NP_RNG_STATE]
        if not isinstance(rng, Mapping) or rng.get("bit_generator") != type(self.np_rng.bit_generator).__name__:
            raise ValueError(
                f"data sampler state: {CURRICULUM_LEARNING_NP_RNG_STATE} is not a "
                f"{type(self.np_rng.bit_generator).__name__} state (a DeepSpeed checkpoint's NumPy state is not read)"
            )
        self.np_rng.bit_generator.state = dict(rng)
        for metric, saved in state_dict.get("curriculum_schedulers", {}).items():
            if metric in self.curriculum_schedulers:
                self.curriculum_schedulers[metric].load_state_dict(saved)
        self.data_clusters, self.data_cluster_sizes = [], []
        if self.global_rank == 0:
            for name in self.data_cluster_paths:
                self.data_clusters.append(MMapIndexedDataset(f"{self.cluster_root}/{name}"))
                self.data_cluster_sizes.append(len(self.data_clusters[-1][0]))
