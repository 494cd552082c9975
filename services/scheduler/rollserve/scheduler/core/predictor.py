"""Response-length predictor: how many tokens will a sample of this prompt generate?

Pure: synchronous, no I/O, no clock reads. The ``rl`` policy orders work longest-first,
balances predicted tokens across engines and defers the predicted tail with it.

Why it works: RL response lengths are long-tailed (longest ≈ 25–32x the median), but a
prompt's identity explains ~65% of their variance and a prompt in the tail stays there
across policy updates (TailSieve), and the samples of one group have correlated lengths
(Seer). So the estimate is built from the prompt's own history, the group's finished
siblings, and a prior for prompts never seen.

Estimator
---------
Everything is kept in log space, ``y = log(1 + length)``, where lengths are close to
lognormal. Time is counted in epochs (passes over the dataset; the caller passes the
epoch of each observation). The predictor's clock is the newest epoch it has seen
(``observe`` or ``advance_epoch``); an observation ``a`` epochs older than the clock
weighs ``2 ** (-a / half_life_epochs)``, so the estimate follows the policy's drift.

1. **History**, per ``prompt_key``, O(1) memory: the decayed weight sum ``W``, the decayed
   sum of squared weights ``V2``, the weighted mean and weighted sum of squared deviations
   of ``y`` (West's incremental update), the raw count, the epoch of the last update, and
   ``epochs``: the decayed number of epochs the key was observed in. An observation of an
   epoch older than the key's last one (a late arrival) weighs by its age and does not
   count as a new epoch.
2. **Prior** for a prompt without history: the decayed global distribution of ``y`` over all
   observations. When ``prompt_len`` is given (> 0) it is adjusted by the prompt-length
   bucket ``prompt_len.bit_length()`` (powers of two): the bucket's decayed mean and
   variance, shrunk toward the global ones with the weight of ``_BUCKET_PSEUDO_COUNT``
   observations. With nothing observed at all the prior is a lognormal of log-variance
   ``_DEFAULT_LOG_VAR`` whose mean is ``default_len``.
3. **Combination** (a random-effects model: a prompt's current log-center ``mu`` is drawn
   around the prior's center, its samples scatter around ``mu`` with a within-prompt
   variance). Evidence is counted in *epochs*: the key's history weighs its decayed
   ``epochs``; each finished sibling of the group being predicted weighs ``sibling_weight``
   (default 1: one sibling counts as much as one whole epoch of history, because siblings
   share this step's policy and their lengths are correlated, while history may be stale);
   the prior weighs ``prior_weight``. The center is the weighted mean of the history's
   mean, the siblings' mean and the prior's mean. The within-prompt variance pools the
   key's own scatter, the siblings' scatter and the global pooled within-prompt variance
   (worth ``_POOL_PSEUDO_COUNT`` observations); the global pool is learnt from every
   key's incremental deviations and starts at ``_WITHIN_SHARE`` of the prior's variance.
   The predictive log-variance is the within-prompt variance plus the center's remaining
   uncertainty, ``between * prior_weight / (prior_weight + evidence)`` with ``between`` the
   prior's variance minus the pooled within-prompt one, plus, when history and siblings
   disagree beyond their sampling noise (the policy drifted), the excess of their squared
   gap times ``w_h * w_s / (w_h + w_s)^2`` (``w_h``, ``w_s`` their weights): the spread of
   the two-point mixture.
4. **Running siblings** are a lower bound: a sibling that has generated ``P`` tokens and not
   finished will produce more than ``P``. With ``P`` the most progress among them, the
   prediction is the lognormal *conditioned on length > P*:
   ``mean = E[L | L > P]`` and ``p90`` its conditional 90% quantile (both >= P). It then
   describes the group's furthest-running sample, which sets when the group finishes: what
   longest-first ordering and tail deferral need. A caller that wants the total
   outstanding tokens of the other samples predicts them again without this argument.
   (This choice over ``max(mean, P * factor)``: it has no tuning factor, barely moves a
   prediction when ``P`` is well short of it, and comes just above ``P`` far beyond it.)

Finished siblings are a biased sample (the short ones finish first); the running
siblings' lower bound corrects that as the long ones keep going. Pass as
``finished_siblings`` only lengths not yet given to ``observe`` (the ``rl`` policy observes
a group's lengths when the group is done), or they count twice.

The prediction's ``mean`` is ``E[L] = exp(mu + var / 2) - 1`` (expected tokens, what load
balancing sums), ``p90`` the 90% quantile ``exp(mu + 1.2816 * sd) - 1``, ``source`` the
evidence with the larger weight (``"history"`` or ``"siblings"``; ``"prior"`` when there is
neither) and ``confidence`` the share of the center that comes from this prompt's own
evidence rather than the prior, ``evidence / (evidence + prior_weight)`` (0 for the prior).

Settings (:class:`PredictorSettings`)
-------------------------------------
- ``half_life_epochs`` (2.0, > 0, ``inf`` allowed): epochs after which an observation weighs
  half as much.
- ``sibling_weight`` (1.0, >= 0): weight of one finished sibling, in epochs of history;
  0 ignores siblings.
- ``prior_weight`` (0.1, > 0): weight of the prior in the center, in epochs of history; the
  ratio of one epoch's noise to the spread between prompts.
- ``default_len`` (512, >= 1): expected length when nothing was observed at all.
- ``max_keys`` (1_000_000, >= 1): prompt keys tracked; beyond it the least recently
  observed (or loaded) key is evicted. The global prior keeps what it learnt from them.
- ``reuse_tolerance`` (0.01, >= 0): how far the prior may move in log space (its center,
  its variance, the pooled within-prompt variance: each by at most this much) before
  :meth:`LengthPredictor.stamp` tells callers to predict again; see Reuse. 0: at any move.

Reuse
-----
A scheduler predicts every queued group at every decision, and every finished sample
moves the prior a little, so a prediction cached until the next observation is made again
for the whole queue after each one. :meth:`LengthPredictor.stamp` gives three counters
instead: the prior's *generation*, which advances when the global prior has moved past
``reuse_tolerance`` since the generation began, when the clock advances or the globals
are loaded; the generation of the prompt's length bucket, which advances when that
bucket's prior alone did; and the key's own, which changes at each observation (or load,
or eviction) of that key. A prediction made at the same stamp from the same siblings
differs from a new one only by the prior's drift: the prior's log-center, log-variance and
pooled within-prompt variance each stay within ``reuse_tolerance`` of where the generation
began (about twice that for a bucket, whose prior also follows the global one), so
predictions made in one generation are within a few times that of each other (on a
drifting workload kept means stayed within 2.1% of new ones: ``test_predictor.py``).

Durability
----------
``dump_key``/``load_key`` map one key to a Redis hash field (``field = prompt_key``,
``value`` = 57 bytes), ``dump_globals``/``load_globals`` the prior and the clock to one more
value. Both round-trip exactly (IEEE doubles). Iterating the predictor yields its keys
oldest-use first; loading them in that order restores the eviction order.

Metrics: :func:`mean_absolute_error` and :func:`tail_auc` score predictions against the
lengths that came.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

PredictionSource = Literal["history", "siblings", "prior"]

_STD_NORMAL = NormalDist()
# The high quantile reported as ``p90``.
_TAIL_QUANTILE = 0.9
_Z_TAIL = _STD_NORMAL.inv_cdf(_TAIL_QUANTILE)
# Log-variance assumed before anything is observed: log-sd 1 puts the longest of 10^4
# responses near e^3.7 ≈ 40x the median, close to the 25–32x reported for RL rollouts.
_DEFAULT_LOG_VAR = 1.0
# Share of log-length variance within a prompt before any within-prompt scatter is seen:
# prompt identity explains ~65% of it (TailSieve).
_WITHIN_SHARE = 0.35
# Weight, in observations, of the pooled within-prompt variance against a key's own scatter.
_POOL_PSEUDO_COUNT = 4.0
# Weight, in observations, of the global prior against a prompt-length bucket's statistics.
_BUCKET_PSEUDO_COUNT = 16.0
# Floor of the predictive log-variance (keeps the lognormal proper for constant lengths).
_MIN_LOG_VAR = 1e-6
# A key whose decayed history weighs less than this starts afresh.
_MIN_WEIGHT = 1e-12
# Beyond this many standard deviations the conditional tail uses its exponential limit
# (the normal survival function underflows a little further out).
_ASYMPTOTIC_ALPHA = 25.0

_KEY_FORMAT = struct.Struct("<Bqqddddd")  # version, last_epoch, count, W, V2, mean, m2, epochs
_KEY_VERSION = 1
_GLOBALS_HEADER = struct.Struct("<BqI")  # version, epoch, number of buckets
_GLOBALS_BODY = struct.Struct("<ddddd")  # global weight, mean, m2; within-pool sum, weight
_BUCKET_FORMAT = struct.Struct("<Bddd")  # bucket, weight, mean, m2
_GLOBALS_VERSION = 1


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    """The predictor's settings; see the module docstring for what each does."""

    half_life_epochs: float = 2.0
    sibling_weight: float = 1.0
    prior_weight: float = 0.1
    default_len: int = 512
    max_keys: int = 1_000_000
    reuse_tolerance: float = 0.01

    def __post_init__(self) -> None:
        if not self.half_life_epochs > 0:
            raise ValueError(
                f"half_life_epochs ({self.half_life_epochs}) must be > 0; "
                "use inf to keep every epoch at full weight"
            )
        if not (math.isfinite(self.sibling_weight) and self.sibling_weight >= 0):
            raise ValueError(
                f"sibling_weight ({self.sibling_weight}) must be a finite number >= 0; "
                "0 ignores finished siblings"
            )
        if not (math.isfinite(self.prior_weight) and self.prior_weight > 0):
            raise ValueError(f"prior_weight ({self.prior_weight}) must be a finite number > 0")
        if self.default_len < 1:
            raise ValueError(f"default_len ({self.default_len}) must be >= 1 token")
        if self.max_keys < 1:
            raise ValueError(f"max_keys ({self.max_keys}) must be >= 1")
        if not (math.isfinite(self.reuse_tolerance) and self.reuse_tolerance >= 0):
            raise ValueError(
                f"reuse_tolerance ({self.reuse_tolerance}) must be a finite number >= 0; "
                "0 makes every prediction anew after any change of the prior"
            )


@dataclass(frozen=True, slots=True)
class Prediction:
    """Predicted response length of one sample, in tokens."""

    mean: float  # expected tokens
    p90: float  # 90% quantile, for tail decisions
    source: PredictionSource
    confidence: float  # in [0, 1]: share of the estimate from this prompt's own evidence


@dataclass(frozen=True, slots=True)
class LengthFit:
    """What the predictor believes of a remaining sample's length ``L`` before anything about
    that sample itself is known: ``log(1 + L) ~ N(mu, var)``. Conditioning on the sample's
    own progress is cheap (:meth:`mean_above`), so a caller that predicts every running
    sample at every decision fits once per group and conditions per sample."""

    mu: float
    var: float
    source: PredictionSource
    confidence: float

    def mean_above(self, floor: int) -> float:
        """Expected ``L`` given ``L > floor`` (``floor`` <= 0: unconditioned)."""
        return _lognormal_mean(self.mu, self.var, floor)


@dataclass(slots=True)
class _Moments:
    """Decayed weighted mean and sum of squared deviations (West's update)."""

    weight: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, y: float, w: float) -> None:
        if w <= 0:  # aged to nothing (an epoch far behind the clock) counts for nothing
            return
        total = self.weight + w
        delta = y - self.mean
        self.mean += delta * w / total
        self.m2 += w * delta * (y - self.mean)
        self.weight = total

    def scale(self, factor: float) -> None:
        self.weight *= factor
        self.m2 *= factor

    @property
    def variance(self) -> float:
        return self.m2 / self.weight if self.weight > 0 else 0.0


@dataclass(slots=True)
class _KeyStats:
    """One prompt's history, as of its ``last_epoch``."""

    last_epoch: int
    count: int = 0  # observations ever, undecayed
    weight: float = 0.0  # W: decayed sum of weights
    weight_sq: float = 0.0  # V2: decayed sum of squared weights
    mean: float = 0.0  # weighted mean of log(1 + length)
    m2: float = 0.0  # weighted sum of squared deviations from the mean
    epochs: float = 0.0  # decayed number of epochs observed in
    stamp: int = 0  # the predictor's observations counted at this key's last (or its load)


class LengthPredictor:
    """Predicts response lengths from prompt history, finished siblings and a prior."""

    def __init__(self, settings: PredictorSettings | None = None) -> None:
        self.settings = settings if settings is not None else PredictorSettings()
        self._keys: OrderedDict[str, _KeyStats] = OrderedDict()
        self._epoch = 0
        self._global = _Moments()
        self._buckets: dict[int, _Moments] = {}
        # Pooled within-prompt variance: sum of incremental squared deviations and the
        # weight that sum estimates the variance for.
        self._within_sum = 0.0
        self._within_weight = 0.0
        # Reuse (module docstring): observations counted (keys' stamps), the prior's
        # generation and each prompt-length bucket's, and the prior as they began: (mu, var,
        # pooled within-prompt variance) per bucket, 0 being the global prior.
        self._observations = 0
        self._generation = 0
        self._bucket_generations: dict[int, int] = {}
        self._bucket_moves = 0  # new bucket generations, all buckets together
        self._began: dict[int, tuple[float, float, float]] = {}
        self._new_generation()

    # -- bookkeeping -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The predictor's clock: the newest epoch observed or advanced to."""
        return self._epoch

    def last_epoch(self, prompt_key: str) -> int | None:
        """The newest epoch ``prompt_key`` was observed in; None if it is not tracked."""
        stats = self._keys.get(prompt_key)
        return None if stats is None else stats.last_epoch

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, prompt_key: object) -> bool:
        return prompt_key in self._keys

    def __iter__(self) -> Iterator[str]:
        """Tracked prompt keys, least recently observed first (the eviction order)."""
        return iter(tuple(self._keys))

    def _decay(self, age: float) -> float:
        return 2.0 ** (-age / self.settings.half_life_epochs) if age > 0 else 1.0

    def advance_epoch(self, epoch: int) -> None:
        """Move the clock to ``epoch`` (no-op if not newer), decaying the global prior."""
        _check_non_negative("epoch", epoch)
        if epoch <= self._epoch:
            return
        factor = self._decay(epoch - self._epoch)
        self._global.scale(factor)
        for bucket in self._buckets.values():
            bucket.scale(factor)
        self._within_sum *= factor
        self._within_weight *= factor
        self._epoch = epoch
        self._new_generation()  # histories weigh by their age against the clock

    def stamp(self, prompt_key: str, prompt_len: int = 0) -> tuple[int, int, int]:
        """What a prediction for ``prompt_key`` (of a ``prompt_len``-token prompt) rests
        on, as counters: the prior's generation, its prompt-length bucket's, and the key's
        last observation (-1: untracked). A prediction made at the same stamp from the same
        siblings may be kept (module docstring, Reuse)."""
        stats = self._keys.get(prompt_key)
        bucket = self._bucket_generations.get(prompt_len.bit_length(), 0) if prompt_len else 0
        return self._generation, bucket, -1 if stats is None else stats.stamp

    @property
    def generations(self) -> tuple[int, int]:
        """The prior's generation and how many bucket generations began: while both stay,
        only the stamps of keys observed (or loaded) since have changed."""
        return self._generation, self._bucket_moves

    def bucket_generations(self) -> dict[int, int]:
        """Each prompt-length bucket's generation (a copy), by ``prompt_len.bit_length()``."""
        return dict(self._bucket_generations)

    def _summary(self, prompt_len: int) -> tuple[float, float, float]:
        mu, var = self._prior(prompt_len)
        return mu, var, self._pool_variance(var)

    def _new_generation(self) -> None:
        self._generation += 1
        self._began = {0: self._summary(0)}
        for bucket in self._buckets:
            self._began[bucket] = self._summary(1 << (bucket - 1))

    def _moved(self, now: tuple[float, ...], began: tuple[float, ...]) -> bool:
        tolerance = self.settings.reuse_tolerance
        return any(abs(a - b) > tolerance for a, b in zip(now, began, strict=True))

    def _check_prior(self, prompt_len: int) -> None:
        """Begins a new generation if the global prior moved past ``reuse_tolerance`` since
        this one began, or only ``prompt_len``'s bucket's if that bucket did (a bucket new
        since then is measured against the global prior its prompts were predicted from)."""
        if self._moved(self._summary(0), self._began[0]):
            self._new_generation()
            return
        bucket = prompt_len.bit_length()
        if not bucket:
            return
        now = self._summary(prompt_len)
        if self._moved(now, self._began.get(bucket, self._began[0])):
            self._bucket_generations[bucket] = self._bucket_generations.get(bucket, 0) + 1
            self._bucket_moves += 1
            self._began[bucket] = now

    # -- learning ----------------------------------------------------------------

    def observe(self, prompt_key: str, length: int, epoch: int = 0, prompt_len: int = 0) -> None:
        """Record a finished sample's response ``length`` (tokens) for ``prompt_key``.

        ``prompt_len`` (> 0) also feeds the prompt-length bucket of the prior; 0 is unknown.
        """
        _check_non_negative("length", length)
        _check_non_negative("epoch", epoch)
        _check_non_negative("prompt_len", prompt_len)
        self.advance_epoch(epoch)
        y = math.log1p(length)
        w_now = self._decay(self._epoch - epoch)  # weight against the clock
        self._global.add(y, w_now)
        if prompt_len > 0:
            self._buckets.setdefault(prompt_len.bit_length(), _Moments()).add(y, w_now)

        stats = self._keys.get(prompt_key)
        if stats is None:
            stats = _KeyStats(last_epoch=epoch)
            self._insert(prompt_key, stats)
        else:
            self._keys.move_to_end(prompt_key)
        self._observations += 1
        stats.stamp = self._observations
        self._add_history(stats, y, epoch, w_now)
        self._check_prior(prompt_len)

    def _add_history(self, stats: _KeyStats, y: float, epoch: int, w_now: float) -> None:
        """Adds ``y`` of ``epoch`` to a key's history and its scatter to the global pool."""
        w = self._age_key(stats, epoch)  # weight against the key's last epoch
        stats.count += 1
        if stats.weight <= 0:
            stats.weight, stats.weight_sq, stats.mean, stats.m2 = w, w * w, y, 0.0
            return
        weight, weight_sq = stats.weight, stats.weight_sq
        total = weight + w
        delta = y - stats.mean
        stats.mean += delta * w / total
        increment = w * delta * (y - stats.mean)
        stats.m2 += increment
        stats.weight = total
        stats.weight_sq = weight_sq + w * w
        # E[increment] = var * w * W / (W + w) * (1 + V2 / W^2): the old mean's own
        # error adds V2 / W^2. Pool increments with that expected weight, by recency.
        self._within_sum += w_now * increment
        self._within_weight += w_now * w * weight / total * (1.0 + weight_sq / (weight * weight))

    def _age_key(self, stats: _KeyStats, epoch: int) -> float:
        """Decay ``stats`` up to ``epoch`` if newer; return the new observation's weight."""
        if stats.weight <= 0:  # fresh key
            stats.last_epoch, stats.epochs = max(stats.last_epoch, epoch), 1.0
            return self._decay(stats.last_epoch - epoch)
        if epoch < stats.last_epoch:  # a late observation of an older epoch
            return self._decay(stats.last_epoch - epoch)
        if epoch > stats.last_epoch:
            factor = self._decay(epoch - stats.last_epoch)
            stats.weight *= factor
            stats.weight_sq *= factor * factor
            stats.m2 *= factor
            stats.epochs = stats.epochs * factor + 1.0
            stats.last_epoch = epoch
            if stats.weight < _MIN_WEIGHT:  # too old to matter: start afresh
                stats.weight = stats.weight_sq = stats.m2 = 0.0
                stats.epochs = 1.0
        return 1.0

    def _insert(self, prompt_key: str, stats: _KeyStats) -> None:
        self._keys[prompt_key] = stats
        self._keys.move_to_end(prompt_key)
        while len(self._keys) > self.settings.max_keys:
            self._keys.popitem(last=False)

    # -- predicting --------------------------------------------------------------

    def predict(
        self,
        prompt_key: str,
        prompt_len: int = 0,
        finished_siblings: Sequence[int] = (),
        running_siblings_progress: Sequence[int] = (),
    ) -> Prediction:
        """Predict the response length of a remaining sample of ``prompt_key``'s group.

        ``finished_siblings``: lengths of the group's finished samples of this step, not yet
        observed. ``running_siblings_progress``: tokens generated so far by its running
        samples; the furthest one conditions the prediction on length > that progress.
        Reads only: predicting does not change the eviction order.
        """
        for progress in running_siblings_progress:
            _check_non_negative("running sibling progress", progress)
        fit = self.fit(prompt_key, prompt_len, finished_siblings)
        floor = max(running_siblings_progress, default=0)
        mean, p90 = _lognormal_summary(fit.mu, fit.var, floor)
        return Prediction(mean=mean, p90=p90, source=fit.source, confidence=fit.confidence)

    def fit(
        self, prompt_key: str, prompt_len: int = 0, finished_siblings: Sequence[int] = ()
    ) -> LengthFit:
        """The log-length distribution :meth:`predict` conditions on running progress."""
        _check_non_negative("prompt_len", prompt_len)
        for length in finished_siblings:
            _check_non_negative("finished sibling length", length)

        prior_mu, prior_var = self._prior(prompt_len)
        stats = self._keys.get(prompt_key)
        history_weight = 0.0
        if stats is not None and stats.weight > 0:
            history_weight = stats.epochs * self._decay(self._epoch - stats.last_epoch)
        sibling_weight = self.settings.sibling_weight * len(finished_siblings)

        source: PredictionSource
        if history_weight <= 0 and sibling_weight <= 0:
            source, mu, var, confidence = "prior", prior_mu, prior_var, 0.0
        else:
            pool_var = self._pool_variance(prior_var)
            prior_weight = self.settings.prior_weight
            center_sum, center_weight = prior_weight * prior_mu, prior_weight
            scatter, dof = _POOL_PSEUDO_COUNT * pool_var, _POOL_PSEUDO_COUNT
            history_mean, history_n = 0.0, 1.0
            if stats is not None and history_weight > 0:
                history_mean = stats.mean
                center_sum += history_weight * history_mean
                center_weight += history_weight
                if stats.weight_sq > 0:
                    # Reliability weights: n_eff = W^2 / V2; unbiased variance times n_eff - 1.
                    history_n = stats.weight**2 / stats.weight_sq
                    scatter += stats.m2 * stats.weight / stats.weight_sq
                    dof += max(history_n - 1.0, 0.0)
            sibling_mean = 0.0
            if sibling_weight > 0:
                ys = [math.log1p(length) for length in finished_siblings]
                sibling_mean = math.fsum(ys) / len(ys)
                center_sum += sibling_weight * sibling_mean
                center_weight += sibling_weight
                scatter += math.fsum((y - sibling_mean) ** 2 for y in ys)
                dof += len(ys) - 1
            evidence = history_weight + sibling_weight
            within = scatter / dof
            between = max(prior_var - pool_var, 0.0)
            mu = center_sum / center_weight
            var = within + between * prior_weight / (prior_weight + evidence)
            if history_weight > 0 and sibling_weight > 0:
                # Drift: history and siblings disagreeing beyond their sampling noise.
                noise = within * (1.0 / history_n + 1.0 / len(finished_siblings))
                excess = (history_mean - sibling_mean) ** 2 - noise
                var += max(excess, 0.0) * history_weight * sibling_weight / evidence**2
            source = "siblings" if sibling_weight >= history_weight else "history"
            confidence = evidence / (evidence + prior_weight)

        return LengthFit(mu, max(var, _MIN_LOG_VAR), source, confidence)

    def _prior(self, prompt_len: int) -> tuple[float, float]:
        """Log-mean and log-variance for a prompt with no evidence of its own."""
        glob = self._global
        if glob.weight <= 0:
            return math.log1p(self.settings.default_len) - _DEFAULT_LOG_VAR / 2, _DEFAULT_LOG_VAR
        mu, var = glob.mean, glob.variance
        bucket = self._buckets.get(prompt_len.bit_length()) if prompt_len > 0 else None
        if bucket is not None and bucket.weight > 0:
            total = bucket.weight + _BUCKET_PSEUDO_COUNT
            mu = (bucket.weight * bucket.mean + _BUCKET_PSEUDO_COUNT * glob.mean) / total
            var = (bucket.m2 + _BUCKET_PSEUDO_COUNT * var) / total
        return mu, var

    def _pool_variance(self, prior_var: float) -> float:
        """Within-prompt log-variance pooled over keys, shrunk toward a share of the prior's."""
        start = _WITHIN_SHARE * prior_var
        return (self._within_sum + _POOL_PSEUDO_COUNT * start) / (
            self._within_weight + _POOL_PSEUDO_COUNT
        )

    # -- durability --------------------------------------------------------------

    def dump_key(self, prompt_key: str) -> bytes:
        """The key's history as a Redis hash value (raises KeyError if untracked)."""
        s = self._keys[prompt_key]
        return _KEY_FORMAT.pack(
            _KEY_VERSION, s.last_epoch, s.count, s.weight, s.weight_sq, s.mean, s.m2, s.epochs
        )

    def load_key(self, prompt_key: str, data: bytes) -> None:
        """Restore (or replace) a key from :meth:`dump_key`; it becomes the most recent."""
        if len(data) != _KEY_FORMAT.size or data[0] != _KEY_VERSION:
            raise ValueError(
                f"state of key {prompt_key!r} is not a version-{_KEY_VERSION} predictor record "
                f"({len(data)} bytes, expected {_KEY_FORMAT.size}); drop the field to relearn it"
            )
        _, last_epoch, count, weight, weight_sq, mean, m2, epochs = _KEY_FORMAT.unpack(data)
        self._observations += 1
        self._insert(
            prompt_key,
            _KeyStats(
                last_epoch=last_epoch,
                count=count,
                weight=weight,
                weight_sq=weight_sq,
                mean=mean,
                m2=m2,
                epochs=epochs,
                stamp=self._observations,
            ),
        )

    def dump_globals(self) -> bytes:
        """The clock and the prior (global, per-bucket and within-prompt pool) as bytes."""
        parts = [
            _GLOBALS_HEADER.pack(_GLOBALS_VERSION, self._epoch, len(self._buckets)),
            _GLOBALS_BODY.pack(
                self._global.weight,
                self._global.mean,
                self._global.m2,
                self._within_sum,
                self._within_weight,
            ),
        ]
        for index in sorted(self._buckets):
            b = self._buckets[index]
            parts.append(_BUCKET_FORMAT.pack(index, b.weight, b.mean, b.m2))
        return b"".join(parts)

    def load_globals(self, data: bytes) -> None:
        """Restore the clock and the prior from :meth:`dump_globals`; keys are untouched."""
        head = _GLOBALS_HEADER.size + _GLOBALS_BODY.size
        if len(data) < head or data[0] != _GLOBALS_VERSION:
            raise ValueError(
                f"predictor globals are not a version-{_GLOBALS_VERSION} record "
                f"({len(data)} bytes); drop them to relearn the prior"
            )
        _, epoch, n_buckets = _GLOBALS_HEADER.unpack_from(data)
        if len(data) != head + n_buckets * _BUCKET_FORMAT.size:
            raise ValueError(
                f"predictor globals hold {len(data)} bytes, expected "
                f"{head + n_buckets * _BUCKET_FORMAT.size} for {n_buckets} buckets"
            )
        weight, mean, m2, within_sum, within_weight = _GLOBALS_BODY.unpack_from(
            data, _GLOBALS_HEADER.size
        )
        buckets: dict[int, _Moments] = {}
        for i in range(n_buckets):
            index, b_weight, b_mean, b_m2 = _BUCKET_FORMAT.unpack_from(
                data, head + i * _BUCKET_FORMAT.size
            )
            buckets[index] = _Moments(b_weight, b_mean, b_m2)
        self._epoch = epoch
        self._global = _Moments(weight, mean, m2)
        self._buckets = buckets
        self._within_sum, self._within_weight = within_sum, within_weight
        self._new_generation()


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} ({value}) must be >= 0")


def _survival(z: float) -> float:
    """P(Z > z) for a standard normal, accurate far into the upper tail."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _lognormal_mean(mu: float, var: float, floor: int) -> float:
    """Mean of ``L`` with ``log(1 + L) ~ N(mu, var)``, given ``L > floor``."""
    if floor <= 0:
        return max(math.expm1(mu + var / 2), 0.0)
    sd = math.sqrt(var)
    cut = math.log1p(floor)
    alpha = (cut - mu) / sd
    if alpha > _ASYMPTOTIC_ALPHA:
        # Far out the truncated normal is an exponential of rate alpha / sd above the cut.
        rate = max(alpha / sd, 2.0)
        mean = math.exp(cut) * rate / (rate - 1.0) - 1.0
    else:
        mean = math.exp(mu + var / 2) * _survival(alpha - sd) / _survival(alpha) - 1.0
    return max(mean, float(floor))


def _lognormal_summary(mu: float, var: float, floor: int) -> tuple[float, float]:
    """Mean and 90% quantile of ``L`` with ``log(1 + L) ~ N(mu, var)``, given ``L > floor``."""
    mean = _lognormal_mean(mu, var, floor)
    sd = math.sqrt(var)
    if floor <= 0:
        return mean, max(math.expm1(mu + _Z_TAIL * sd), 0.0)
    cut = math.log1p(floor)
    alpha = (cut - mu) / sd
    if alpha > _ASYMPTOTIC_ALPHA:
        rate = max(alpha / sd, 2.0)
        p90 = math.expm1(cut + math.log(1.0 / (1.0 - _TAIL_QUANTILE)) / rate)
    else:
        tail = _survival(alpha)
        p90 = math.expm1(mu - sd * _STD_NORMAL.inv_cdf((1.0 - _TAIL_QUANTILE) * tail))
    return mean, max(p90, float(floor))


# -- accuracy metrics ------------------------------------------------------------


def _check_pairs(name: str, predicted: Sequence[float], actual: Sequence[float]) -> None:
    if len(predicted) != len(actual):
        raise ValueError(
            f"{name}: predicted has {len(predicted)} values, actual {len(actual)}; "
            "pass one prediction per actual length"
        )
    if not actual:
        raise ValueError(f"{name}: no values to score")
    if not all(math.isfinite(v) for v in (*predicted, *actual)):
        raise ValueError(f"{name}: values must be finite (got NaN or inf)")


def mean_absolute_error(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Mean of ``|predicted[i] - actual[i]|``, in tokens.

    Raises ValueError on empty or mismatched inputs.
    """
    _check_pairs("mean_absolute_error", predicted, actual)
    return math.fsum(abs(p - a) for p, a in zip(predicted, actual, strict=True)) / len(actual)


def tail_auc(
    predicted: Sequence[float], actual: Sequence[float], tail_quantile: float = 0.9
) -> float:
    """ROC AUC of ``predicted`` as a score for "actual is in the tail".

    The tail is the ``ceil((1 - tail_quantile) * n)`` largest actual values (at least one),
    plus any tied with the smallest of them. The AUC is the probability that a tail
    sample scores higher than a non-tail one, ties counting half: the Mann–Whitney U of
    the tail's midranks over ``n_tail * n_rest``. 1.0 ranks the tail perfectly, 0.5 is
    chance. O(n log n). Raises ValueError on empty or mismatched inputs, on
    ``tail_quantile`` outside (0, 1), and when every value is in the tail.
    """
    _check_pairs("tail_auc", predicted, actual)
    if not 0 < tail_quantile < 1:
        raise ValueError(f"tail_auc: tail_quantile ({tail_quantile}) must be in (0, 1)")
    n = len(actual)
    # round() first so that (1 - 0.9) * 100 = 10.000000000000002 gives 10, not 11.
    n_top = max(1, math.ceil(round((1.0 - tail_quantile) * n, 9)))
    threshold = sorted(actual, reverse=True)[min(n_top, n) - 1]
    in_tail = [a >= threshold for a in actual]
    n_tail = sum(in_tail)
    n_rest = n - n_tail
    if n_rest == 0:
        raise ValueError(
            "tail_auc: every actual value is in the tail (all tied or too few values); "
            "the AUC is undefined"
        )
    ranks = _midranks(predicted)
    rank_sum = math.fsum(r for r, t in zip(ranks, in_tail, strict=True) if t)
    u = rank_sum - n_tail * (n_tail + 1) / 2
    return u / (n_tail * n_rest)


def _midranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        rank = (start + end) / 2 + 1
        for i in range(start, end + 1):
            ranks[order[i]] = rank
        start = end + 1
    return ranks
