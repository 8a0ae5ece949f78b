"""The TrainerService layer: validation, policy versions, trajectory → Datum, advantages, idempotency and
checkpoint bookkeeping in SQLite, over the tinker SDK (Tinker itself or the embedded engine child).

Behaviours a client can rely on, beyond the proto comments:
- Train is N → N+1 or an error that changes nothing. When staleness drops and zero-variance groups leave
  nothing to train, it fails FAILED_PRECONDITION (ErrorInfo NOTHING_TO_TRAIN, counts in its metadata)
  instead of stepping the optimizer on no data.
- Groups train with a policy-gradient loss (importance sampling by default); supervised examples with
  cross-entropy only. Advantages are reward − group mean, optionally over (population std +
  ADVANTAGE_STD_EPSILON), after stale trajectories were dropped; a trajectory's staleness is measured
  from its oldest sampled turn.
- Stop strings and stop token ids together: Tinker takes one kind per request, so the token ids are sent
  as their decoded texts.
- Nothing acknowledged is lost at any --checkpoint-every K: a version without a full-state checkpoint
  commits a write-ahead record of its step (datums, loss and its config, Adam params) in the transaction
  that commits it, and whenever a training client is rebuilt (restart, engine restart, a Train after a
  failed/cancelled one) it is loaded from the last state checkpoint (the recovery point) and the recorded
  steps after it are replayed (service/recovery.py), so every committed version keeps its number, sampler,
  metrics and weights (bitwise on the CPU engine) and training continues from its optimizer state.
- Idempotency records are never forgotten (restart, replay, RestoreCheckpoint): a retried acknowledged key
  answers replayed=true with its recorded response, also when a restore dropped that version.
- The state checkpoint a model would recover from cannot be deleted (FAILED_PRECONDITION
  RECOVERY_CHECKPOINT), nor can the current version's sampler (CURRENT_SAMPLER_CHECKPOINT).
- Limits (service/limits.py, `tinkerrpc serve --max-...`): Sample's n and max_tokens over the server's limit,
  or a prompt + max_tokens beyond the model's context, are INVALID_ARGUMENT naming the field; a Train batch
  with too many trajectories/examples or tokens is RESOURCE_EXHAUSTED (QuotaFailure naming the flag) and
  changes nothing; an over-size message is grpc's own RESOURCE_EXHAUSTED naming both sizes.
- A Train cut short by its deadline or a client cancel commits nothing; the model is rebuilt at its committed
  version before its next step (weights and optimizer state as if the call never came).
- The embedded engine child is supervised: if it dies, calls in flight fail UNAVAILABLE, new calls wait for
  a new engine (within their deadline), and every model is rebuilt at its committed version.
- SaveCheckpoint without a name at a version that already has its automatic `step_NNNNNN` returns that
  checkpoint (it holds exactly this state); an explicit duplicate name is ALREADY_EXISTS.
"""
