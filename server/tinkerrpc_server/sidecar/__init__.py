"""OpenAI-compatible inference in front of the tinkerrpc gRPC server.

Endpoints: GET /v1/models (+ /v1/models/{id}), POST /v1/chat/completions, POST /v1/completions,
POST /v1/responses (responses.py), GET /health, GET /metrics. Model ids are `name` (latest policy version) or `name@N` (pinned);
responses echo `name@N` for the version that sampled them. RL extensions, named as in vLLM:
requests take `top_k`, `stop_token_ids`, `ignore_eos`, `return_tokens_as_token_ids`; responses
carry `prompt_token_ids`, per-choice `token_ids` and `policy_version` (`return_token_ids`
true/false forces them in or out).

`app.create_app` builds the FastAPI app, `app.run_sidecar` serves it as a process and
`app.serve_sidecar` hosts it on an event loop that already runs (e.g. the gRPC server's).
"""
