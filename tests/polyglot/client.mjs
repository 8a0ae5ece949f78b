// A Node.js client of the tinkerrpc v1 contract, built straight from protos/ with no generated code:
// create a model, sample with logprobs, train one RL step on its own samples, read back the new
// policy version, sample pinned to it and download its adapter (a server stream). Reusing the step's
// idempotency key for another request is refused: the reason is decoded from the status details and
// looked up in the ErrorReason enum. Prints one JSON line of what it observed; exits non-zero
// with the gRPC status code and details on any error or contract mismatch.
//
// Usage: node client.mjs HOST:PORT --google-protos DIR [--token T] [--base-model NAME] [--timeout-s SECONDS]
// --token (default $TINKERRPC_AUTH_TOKEN) is the server's auth token, sent as `authorization: Bearer T`.
// DIR holds googleapis' google/rpc/status.proto and error_details.proto (the test passes the copy
// that ships with Python's googleapis-common-protos).

import { randomUUID } from "node:crypto";
import { existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";

const PROTOS_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "protos");
const DEFAULT_BASE_MODEL = "tinkerrpc/tiny-chat";
const SAMPLES_PER_PROMPT = 4;
const MAX_NEW_TOKENS = 8;
const SAMPLING_SEED = 20240601;
const STATUS_DETAILS_KEY = "grpc-status-details-bin";
const ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo";
// ErrorInfo.reason is an ErrorReason's name without this prefix (errors.proto).
const REASON_PREFIX = "ERROR_REASON_";

// keepCase keeps the proto's snake_case field names, so the code reads like the contract;
// int64 fields arrive as decimal strings (never silently rounded) and go through toInt();
// enums travel as their names.
const LOADER_OPTIONS = {
  includeDirs: [PROTOS_DIR],
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

class ClientFailure extends Error {}

class RpcFailure extends ClientFailure {
  constructor(method, error) {
    const codeName = grpc.status[error.code] ?? "UNKNOWN";
    super(`${method} failed: ${codeName} (${error.code}): ${error.details}`);
    this.codeName = codeName;
    this.metadata = error.metadata;
  }
}

const USAGE = "usage: node client.mjs HOST:PORT --google-protos DIR [--token T] [--base-model NAME] [--timeout-s SECONDS]";

function parseArgs(argv) {
  const args = {
    target: null,
    googleProtos: null,
    token: process.env.TINKERRPC_AUTH_TOKEN ?? null,
    baseModel: DEFAULT_BASE_MODEL,
    timeoutSeconds: 120,
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--google-protos") {
      args.googleProtos = requireValue(argv, ++i, arg);
    } else if (arg === "--token") {
      args.token = requireValue(argv, ++i, arg);
      if (args.token === "") throw new ClientFailure("--token must not be empty");
    } else if (arg === "--base-model") {
      args.baseModel = requireValue(argv, ++i, arg);
    } else if (arg === "--timeout-s") {
      args.timeoutSeconds = Number(requireValue(argv, ++i, arg));
      if (!(args.timeoutSeconds > 0)) throw new ClientFailure(`--timeout-s must be a positive number`);
    } else if (arg.startsWith("--")) {
      throw new ClientFailure(`unknown option ${arg}`);
    } else if (args.target === null) {
      args.target = arg;
    } else {
      throw new ClientFailure(`unexpected argument ${arg}`);
    }
  }
  if (args.target === null || args.googleProtos === null) throw new ClientFailure(USAGE);
  return args;
}

function requireValue(argv, index, option) {
  if (index >= argv.length) throw new ClientFailure(`${option} needs a value`);
  return argv[index];
}

function loadTrainerService() {
  const definition = protoLoader.loadSync("tinkerrpc/v1/trainer_service.proto", LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition).tinkerrpc.v1.TrainerService;
}

/** What decoding a refusal takes, read from the .proto files with protobufjs: google.rpc.Status and
 * ErrorInfo from googleapis, ErrorReason from tinkerrpc. */
function loadErrorTypes(googleProtosDir) {
  const root = new protobuf.Root();
  root.resolvePath = (_origin, target) =>
    [PROTOS_DIR, googleProtosDir].map((dir) => join(dir, target)).find(existsSync) ?? target;
  root.loadSync(
    ["google/rpc/status.proto", "google/rpc/error_details.proto", "tinkerrpc/v1/errors.proto"],
    { keepCase: true },
  );
  return {
    status: root.lookupType("google.rpc.Status"),
    errorInfo: root.lookupType("google.rpc.ErrorInfo"),
    errorReason: root.lookupEnum("tinkerrpc.v1.ErrorReason"),
  };
}

/** Awaits a call that must fail with a gRPC status; returns that RpcFailure. */
async function refusal(pending, what) {
  try {
    await pending;
  } catch (failure) {
    if (failure instanceof RpcFailure) return failure;
    throw failure;
  }
  throw new ClientFailure(`contract mismatch: ${what} was accepted`);
}

/** The ErrorInfo in a failure's status details, its reason mapped to an ErrorReason value. */
function decodeErrorInfo(failure, errorTypes) {
  const [statusBytes] = failure.metadata.get(STATUS_DETAILS_KEY);
  expect(statusBytes !== undefined, `${failure.message} came without ${STATUS_DETAILS_KEY}`);
  const status = errorTypes.status.decode(statusBytes);
  const packed = status.details.find((detail) => detail.type_url === ERROR_INFO_TYPE_URL);
  expect(packed !== undefined, `${failure.message} came without a google.rpc.ErrorInfo`);
  const info = errorTypes.errorInfo.decode(packed.value);
  const reasonName = `${REASON_PREFIX}${info.reason}`;
  const reasonNumber = errorTypes.errorReason.values[reasonName];
  expect(reasonNumber !== undefined, `ErrorInfo.reason ${info.reason} is not an ErrorReason`);
  return { reason: reasonName, reason_number: reasonNumber, domain: info.domain, metadata: info.metadata };
}

/** An int64 received as a decimal string, as a JS number; refuses values a double cannot hold. */
function toInt(value, field) {
  const number = Number(value);
  if (!Number.isSafeInteger(number)) throw new ClientFailure(`${field} = ${value} is not a safe integer`);
  return number;
}

function expect(condition, message) {
  if (!condition) throw new ClientFailure(`contract mismatch: ${message}`);
}

/** Wraps a callback-style unary stub in a promise with a per-call deadline; appends each call's
 * method and wall time (ms) to `timings`. */
function unaryCaller(stub, metadata, timeoutSeconds, timings) {
  return (method, request) =>
    new Promise((resolve, reject) => {
      const started = performance.now();
      const deadline = new Date(Date.now() + timeoutSeconds * 1000);
      stub[method](request, metadata, { deadline }, (error, response) => {
        timings.push([method, Math.round(performance.now() - started)]);
        if (error) reject(new RpcFailure(method, error));
        else resolve(response);
      });
    });
}

/** Opens WatchModel (a server stream that lasts until cancelled) and resolves with its first `count`
 * events once `during` (started when the first `replayed` events arrived, to cause a live one) is done;
 * the stream is cancelled then. */
function watchEvents(stub, metadata, request, count, replayed, during, timeoutSeconds) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + timeoutSeconds * 1000);
    const stream = stub.WatchModel(request, metadata, { deadline });
    const events = [];
    let caused = null;
    let done = false;
    const fail = (failure) => {
      if (done) return;
      done = true;
      stream.cancel();
      reject(failure);
    };
    stream.on("data", (event) => {
      if (done) return;
      events.push(event);
      if (events.length === replayed) caused = during();
      if (events.length === count) {
        done = true;
        caused.then(() => {
          stream.cancel();
          resolve(events);
        }, reject);
      }
    });
    stream.on("error", (error) => fail(new RpcFailure("WatchModel", error)));
  });
}

/** Receives ExportWeights (a server stream) within a deadline: the first message describes the export,
 * the rest are file chunks in order. Resolves to the description and each file's bytes; checks offsets
 * and sizes against the description. */
function exportWeights(stub, metadata, request, timeoutSeconds, timings) {
  return new Promise((resolve, reject) => {
    const started = performance.now();
    const deadline = new Date(Date.now() + timeoutSeconds * 1000);
    const stream = stub.ExportWeights(request, metadata, { deadline });
    let weights = null;
    const pieces = new Map();
    const fail = (failure) => {
      stream.cancel();
      reject(failure);
    };
    stream.on("data", (response) => {
      if (response.part === "weights") {
        if (weights !== null) return fail(new ClientFailure("contract mismatch: the export was described twice"));
        weights = response.weights;
        for (const file of weights.files) pieces.set(file.path, []);
        return undefined;
      }
      const { path, offset, data } = response.chunk;
      if (weights === null || !pieces.has(path)) {
        return fail(new ClientFailure(`contract mismatch: unexpected chunk of ${path}`));
      }
      const received = pieces.get(path).reduce((total, piece) => total + piece.length, 0);
      if (toInt(offset, "chunk.offset") !== received) {
        return fail(new ClientFailure(`contract mismatch: ${path} chunk at ${offset}, expected ${received}`));
      }
      pieces.get(path).push(data);
      return undefined;
    });
    stream.on("error", (error) => reject(new RpcFailure("ExportWeights", error)));
    stream.on("end", () => {
      timings.push(["ExportWeights", Math.round(performance.now() - started)]);
      if (weights === null) return reject(new ClientFailure("contract mismatch: the export stream was empty"));
      const files = new Map([...pieces].map(([path, parts]) => [path, Buffer.concat(parts)]));
      for (const file of weights.files) {
        const size = toInt(file.size_bytes, "size_bytes");
        if (files.get(file.path).length !== size) {
          return reject(new ClientFailure(`contract mismatch: ${file.path} has ${files.get(file.path).length} of ${size} bytes`));
        }
      }
      return resolve({ weights, files });
    });
  });
}

/** Reward rule: 1 when the completion's text has odd length, else 0. */
function rewardFor(text) {
  return text.length % 2;
}

/** The rewards of a group; when the rule gives every sample the same one, alternate by index so the
 * group has variance and the step carries signal. */
function groupRewards(texts) {
  const byRule = texts.map(rewardFor);
  const allEqual = byRule.every((reward) => reward === byRule[0]);
  return { rewards: allEqual ? texts.map((_, index) => index % 2) : byRule, byIndex: allEqual };
}

function checkSequences(response, expectedVersion, label) {
  expect(toInt(response.policy_version, `${label}.policy_version`) === expectedVersion,
    `${label}.policy_version is ${response.policy_version}, expected ${expectedVersion}`);
  response.sequences.forEach((sequence, index) => {
    const where = `${label}.sequences[${index}]`;
    expect(sequence.token_ids.length > 0, `${where} has no tokens`);
    expect(sequence.logprobs.length === sequence.token_ids.length,
      `${where} has ${sequence.logprobs.length} logprobs for ${sequence.token_ids.length} tokens`);
    expect(sequence.logprobs.every((logprob) => Number.isFinite(logprob) && logprob <= 0),
      `${where}.logprobs are not all finite and <= 0`);
    expect(toInt(sequence.policy_version, `${where}.policy_version`) === expectedVersion,
      `${where}.policy_version is ${sequence.policy_version}, expected ${expectedVersion}`);
  });
}

function summariseSequences(response) {
  return response.sequences.map((sequence) => ({
    policy_version: toInt(sequence.policy_version, "policy_version"),
    token_ids: sequence.token_ids.length,
    logprobs: sequence.logprobs.length,
    stop_reason: sequence.stop_reason,
    text: sequence.text,
  }));
}

/** The metadata every call carries: the bearer token the server checks (serve --auth-token), if any. */
function callMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token !== null) metadata.set("authorization", `Bearer ${token}`);
  return metadata;
}

async function run({ target, googleProtos, token, baseModel, timeoutSeconds }) {
  const TrainerService = loadTrainerService();
  const errorTypes = loadErrorTypes(googleProtos);
  const stub = new TrainerService(target, grpc.credentials.createInsecure());
  const timings = [];
  const metadata = callMetadata(token);
  const call = unaryCaller(stub, metadata, timeoutSeconds, timings);
  try {
    const info = await call("GetServerInfo", {});
    const name = `node-${randomUUID().slice(0, 8)}`;
    const created = await call("CreateModel", { name, base_model: baseModel, seed: 0 });
    const createdVersion = toInt(created.model.policy_version, "CreateModel.model.policy_version");
    expect(created.model.name === name, `CreateModel returned model ${created.model.name}, asked for ${name}`);
    expect(createdVersion === 0, `a new model is at policy version ${createdVersion}, expected 0`);

    const prompt = [{ role: "ROLE_USER", content: "Is the sky blue? Answer yes, no or maybe." }];
    const params = { n: SAMPLES_PER_PROMPT, max_tokens: MAX_NEW_TOKENS, temperature: 1, seed: SAMPLING_SEED };
    const sampled = await call("Sample", { model: name, chat: { messages: prompt }, params });
    expect(sampled.sequences.length === SAMPLES_PER_PROMPT,
      `Sample returned ${sampled.sequences.length} sequences, asked for ${SAMPLES_PER_PROMPT}`);
    expect(sampled.prompt_token_ids.length > 0, "Sample returned no prompt_token_ids");
    checkSequences(sampled, 0, "Sample");
    sampled.sequences.forEach((sequence, index) =>
      expect(sequence.message?.role === "ROLE_ASSISTANT",
        `Sample.sequences[${index}].message is not a parsed assistant message for a chat prompt`));

    const { rewards, byIndex } = groupRewards(sampled.sequences.map((sequence) => sequence.text));
    const trajectories = sampled.sequences.map((sequence, index) => ({
      messages: [...prompt, sequence.message],
      turns: [{
        prompt_token_ids: sampled.prompt_token_ids,
        completion_token_ids: sequence.token_ids,
        completion_logprobs: sequence.logprobs,
        policy_version: sequence.policy_version,
      }],
      reward: rewards[index],
      metadata: { client: "node", sample_index: String(index) },
    }));
    const trainRequest = {
      model: name,
      groups: [{ trajectories }],
      adam: { learning_rate: 1e-3 },
      idempotency_key: randomUUID(),
    };
    const trained = await call("Train", trainRequest);
    const trainedVersion = toInt(trained.policy_version, "Train.policy_version");
    const completionTokens = sampled.sequences.reduce((total, sequence) => total + sequence.token_ids.length, 0);
    expect(trainedVersion === 1, `Train moved the model to version ${trainedVersion}, expected 1`);
    expect(trained.replayed === false, "the first Train with a fresh idempotency key says replayed");
    expect(toInt(trained.metrics.trajectories_used, "trajectories_used") === SAMPLES_PER_PROMPT,
      `Train used ${trained.metrics.trajectories_used} trajectories, sent ${SAMPLES_PER_PROMPT}`);
    expect(toInt(trained.metrics.trained_tokens, "trained_tokens") === completionTokens,
      `Train trained ${trained.metrics.trained_tokens} tokens, the samples had ${completionTokens} completion tokens`);

    // The same idempotency key again: the recorded result comes back and no second step applies.
    const retried = await call("Train", trainRequest);
    expect(retried.replayed === true, "a Train retried with the same idempotency key is not marked replayed");
    expect(toInt(retried.policy_version, "Train(retry).policy_version") === 1,
      `the retried Train reports version ${retried.policy_version}, expected 1`);

    // The same key with a different request: refused, and the protos name the reason.
    const reused = await refusal(
      call("Train", { ...trainRequest, adam: { learning_rate: 2e-3 } }),
      "a Train reusing an idempotency key for another request",
    );
    const reusedInfo = decodeErrorInfo(reused, errorTypes);

    const fetched = await call("GetModel", { name });
    const currentVersion = toInt(fetched.model.policy_version, "GetModel.model.policy_version");
    const sampleableVersions = fetched.model.sampleable_versions.map((version) => toInt(version, "sampleable_versions"));
    expect(currentVersion === 1, `GetModel says version ${currentVersion} after one step, expected 1`);
    expect(sampleableVersions.includes(1), `version 1 is not sampleable: [${sampleableVersions}]`);

    const pinned = await call("Sample", {
      model: name,
      policy_version: 1,
      chat: { messages: prompt },
      params: { ...params, n: 2 },
    });
    checkSequences(pinned, 1, "Sample(pinned)");

    const exported = await exportWeights(stub, metadata, { model: name, expected_policy_version: 1 }, timeoutSeconds, timings);
    const adapterConfig = JSON.parse(exported.files.get("adapter_config.json").toString("utf8"));

    // The run so far, then a watch that replays it and sees the next step live.
    const history = await call("GetRunHistory", { model: name });
    const watched = await watchEvents(stub, metadata, { model: name, from_version: 1 }, 2, 1,
      () => call("Train", { ...trainRequest, idempotency_key: randomUUID() }), timeoutSeconds);
    const described = (event) => ({
      kind: event.event,
      policy_version: toInt(event.policy_version, "WatchModelResponse.policy_version"),
      replayed: event.replayed,
      step_version: event.version ? toInt(event.version.policy_version, "RunStep.policy_version") : null,
      trajectories_used: event.version ? toInt(event.version.metrics.trajectories_used, "trajectories_used") : null,
    });

    return {
      target,
      model: name,
      base_model: created.model.base_model,
      renderer: created.model.renderer,
      versions: {
        created: createdVersion,
        sampled: toInt(sampled.policy_version, "policy_version"),
        trained: trainedVersion,
        retried: toInt(retried.policy_version, "policy_version"),
        current: currentVersion,
        pinned_sample: toInt(pinned.policy_version, "policy_version"),
      },
      sampleable_versions: sampleableVersions,
      prompt_tokens: sampled.prompt_token_ids.length,
      samples: summariseSequences(sampled),
      rewards,
      rewards_by_index: byIndex,
      train: {
        replayed_on_retry: retried.replayed,
        loss: trained.metrics.loss,
        trajectories_used: toInt(trained.metrics.trajectories_used, "trajectories_used"),
        trained_tokens: toInt(trained.metrics.trained_tokens, "trained_tokens"),
        total_tokens: toInt(trained.metrics.total_tokens, "total_tokens"),
        sampler_checkpoint: trained.sampler_checkpoint?.name ?? null,
      },
      pinned_samples: summariseSequences(pinned),
      refused: { code: reused.codeName, ...reusedInfo },
      idempotency_key: trainRequest.idempotency_key,
      export: {
        policy_version: toInt(exported.weights.policy_version, "ExportedWeights.policy_version"),
        base_model: exported.weights.base_model,
        file_sizes: Object.fromEntries([...exported.files].map(([path, bytes]) => [path, bytes.length])),
        lora_rank: adapterConfig.r,
      },
      history: history.steps.map((step) => ({
        policy_version: toInt(step.policy_version, "RunStep.policy_version"),
        mean_reward: step.metrics.mean_reward,
        std_reward: step.metrics.std_reward,
        learning_rate: step.metrics.learning_rate,
        trajectories_used: toInt(step.metrics.trajectories_used, "trajectories_used"),
        checkpoints: step.checkpoints.map((checkpoint) => checkpoint.name),
      })),
      history_next_page_token: history.next_page_token,
      watched: watched.map(described),
      server_info: {
        server_version: info.server_version,
        backend: info.backend,
        max_sample_n: toInt(info.limits.max_sample_n, "ServerLimits.max_sample_n"),
        max_top_logprobs: toInt(info.limits.max_top_logprobs, "ServerLimits.max_top_logprobs"),
      },
      rpc_ms: timings,
    };
  } finally {
    stub.close();
  }
}

try {
  const observed = await run(parseArgs(process.argv.slice(2)));
  process.stdout.write(`${JSON.stringify(observed)}\n`);
} catch (error) {
  if (!(error instanceof ClientFailure)) throw error;
  process.stderr.write(`tinkerrpc node client: ${error.message}\n`);
  process.exitCode = 1;
}
