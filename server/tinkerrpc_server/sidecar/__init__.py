"""OpenAI-compatible inference in front of the tinkerrpc gRPC server.

One module per endpoint family, each with its request checks, response and stream builders and route:
models.py (GET /v1/models, /v1/models/{id}, and what a model id means), chat.py (POST
/v1/chat/completions), completions.py (POST /v1/completions), responses.py (POST /v1/responses),
generate.py (POST /inference/v1/generate, vLLM's tokens-in, tokens-out route for RL training clients)
and runs/ (the live run view). They share sampling_args.py (request → the SDK's Sample arguments),
sample_output.py (a Sample → stop-cut text, per-token pieces, logprob entries, usage), streaming.py
(server-sent events) and protocol.py (the wire shapes); app.py adds GET /health and GET /metrics,
authentication and the error handlers. Model ids are `name` (latest policy version) or `name@N` (pinned);
responses echo `name@N` for the version that sampled them. RL extensions, named as in vLLM:
requests take `top_k`, `stop_token_ids`, `ignore_eos`, `return_tokens_as_token_ids`; responses
carry `prompt_token_ids`, per-choice `token_ids`, `policy_version` and `sample_key` (the server's key
for the sampler's logprobs, which a trajectory names to train without them; `return_token_ids`
true/false forces them in or out).

`app.create_app` builds the FastAPI app, `app.run_sidecar` serves it as a process and
`app.serve_sidecar` hosts it on an event loop that already runs (e.g. the gRPC server's).
"""
