// The run view of one model: draws the history from /runs/{model}/state, then follows
// /runs/{model}/events (server-sent events relayed from WatchModel) and redraws without reloading.
// The page's <main id=run> carries data-latest-version, data-points and data-stream for tests, and
// window.runCharts holds the uPlot charts by name. A minibatched Train (several optimizer steps in one
// version) draws each minibatch's loss inside its version on the loss chart.
"use strict";
(function () {
  const root = document.getElementById("run");
  const base = "/runs/" + encodeURIComponent(root.dataset.model);
  let steps = []; // one entry per policy version, ascending
  const charts = {};
  window.runCharts = charts;
  // Policy versions are whole numbers: the x axis ticks only at these spacings.
  const VERSION_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];

  function staleness(step) {
    let count = 0, sum = 0, max = null;
    for (const [k, n] of Object.entries(step.staleness)) {
      const s = Number(k);
      count += n; sum += s * n;
      if (n > 0 && (max === null || s > max)) max = s;
    }
    return [count ? sum / count : null, max];
  }

  const CHARTS = {
    reward: { title: "Reward (mean ± std)", series: [
      { label: "mean", stroke: "#1f6feb", width: 2, value: (s) => s.reward },
      { label: "mean + std", stroke: "#9ab8ea", dash: [4, 4], value: (s) => (s.reward === null || s.std === null ? null : s.reward + s.std) },
      { label: "mean − std", stroke: "#9ab8ea", dash: [4, 4], value: (s) => (s.reward === null || s.std === null ? null : s.reward - s.std) },
    ] },
    // Every point is one optimizer step's loss, summed over that step's trained tokens, so a minibatched
    // version's line point is its loss per minibatch (its loss is their sum) and sits among them.
    loss: { title: "Loss per optimizer step (summed over its tokens)", data: lossData, xLabel: lossXLabel, series: [
      { label: "loss (version's mean per minibatch)", stroke: "#d9480f", width: 2, spanGaps: true },
      { label: "minibatch loss", stroke: "#f59f00", pointSize: 4 },
    ] },
    staleness: { title: "Staleness (versions behind) and dropped trajectories", series: [
      { label: "mean staleness", stroke: "#7048e8", width: 2, value: (s) => staleness(s)[0] },
      { label: "max staleness", stroke: "#b197fc", value: (s) => staleness(s)[1] },
      { label: "dropped stale", stroke: "#e8590c", value: (s) => s.dropped_stale },
      { label: "dropped zero-variance", stroke: "#868e96", value: (s) => s.dropped_zero_variance },
    ] },
    throughput: { title: "Throughput (tokens per second)", series: [
      { label: "tokens/s", stroke: "#2b8a3e", width: 2, value: (s) => s.tps },
    ] },
    mismatch: { title: "Sampler/learner mismatch (RL steps, sampled tokens)", series: [
      { label: "KL (k3)", stroke: "#c2255c", width: 2, value: (s) => s.kl },
      // Named with the server's bounds once the state arrives (mismatch_ratio_bounds).
      { label: "fraction of ratios outside the bounds", stroke: "#f783ac", value: (s) => s.ratio_outside },
    ] },
  };

  // A value axis as wide as its widest tick label (uPlot's fixed 50 px cut "10,000" to "0,000"). uPlot
  // measures in canvas pixels (CSS pixels times its pixel ratio) and sizes axes in CSS pixels.
  function valueAxisSize(u, labels, axisIndex) {
    const axis = u.axes[axisIndex];
    u.ctx.font = axis.font[0];
    let widest = 0;
    for (const label of labels || []) widest = Math.max(widest, u.ctx.measureText(String(label)).width);
    return Math.ceil(axis.ticks.size + axis.gap + widest / uPlot.pxRatio) + 2;
  }

  // Value tick labels as precise as their spacing: uPlot's default keeps 3 decimals, so a KL of a few
  // 1e-5 read "0" on every tick. Spacings under 1e-4 are written in exponent form (2e-14, 2.5e-14).
  function valueAxisLabels(u, splits, axisIndex, space, incr) {
    if (incr > 0 && incr < 1e-4) {
      return splits.map((value) => (value === null ? "" : value === 0 ? "0" : Number(value.toPrecision(6)).toExponential()));
    }
    let decimals = 0;
    while (decimals < 8 && Math.abs(Math.round(incr * 10 ** decimals) - incr * 10 ** decimals) > 1e-6 * incr * 10 ** decimals) decimals++;
    const format = new Intl.NumberFormat(undefined, { minimumFractionDigits: decimals, maximumFractionDigits: decimals });
    return splits.map((value) => (value === null ? "" : format.format(value)));
  }

  // A minibatched version's K minibatch losses sit at v-1 + (k+1)/K, k = 0..K-1: the last one on v.
  function minibatchX(step, k) {
    return step.v - 1 + (k + 1) / step.minibatch_losses.length;
  }

  function lossPerStep(step) {
    const k = step.minibatch_losses.length;
    return step.loss === null || k === 0 ? step.loss : step.loss / k;
  }

  // The loss chart's x values (versions and the minibatches inside them), with what each one is.
  let lossPoints = [];
  function lossData() {
    lossPoints = [];
    const data = [[], [], []];
    for (const step of steps) {
      const losses = step.minibatch_losses;
      losses.forEach((loss, k) => {
        const last = k === losses.length - 1;
        lossPoints.push(`version ${step.v}, minibatch ${k + 1} of ${losses.length}`);
        data[0].push(minibatchX(step, k));
        data[1].push(last ? lossPerStep(step) : null);
        data[2].push(loss);
      });
      if (!losses.length) {
        lossPoints.push(`version ${step.v}`);
        data[0].push(step.v);
        data[1].push(step.loss);
        data[2].push(null);
      }
    }
    return data;
  }

  function lossXLabel(u, x, seriesIndex, index) {
    return index === null || index === undefined ? "--" : lossPoints[index];
  }

  function chartData(spec) {
    if (spec.data) return spec.data();
    return [steps.map((s) => s.v), ...spec.series.map((series) => steps.map(series.value))];
  }

  // Every chart's x axis starts where the first version does: at v-1 when it is minibatched (its
  // minibatches fill (v-1, v]), so the charts stay aligned.
  function xRange(u, min, max) {
    if (min === null || max === null) return [min, max];
    const first = steps.length ? steps[0] : null;
    const low = first && first.minibatch_losses.length > 1 ? Math.min(min, first.v - 1) : min;
    return low === max ? [low - 1, max + 1] : [low, max];
  }

  function draw() {
    for (const [name, spec] of Object.entries(CHARTS)) {
      const element = document.getElementById("chart-" + name);
      if (!charts[name]) {
        const width = Math.max(element.clientWidth - 12, 300);
        charts[name] = new uPlot({
          title: spec.title, width, height: 240,
          scales: { x: { time: false, range: xRange } },
          axes: [{ label: "policy version", incrs: VERSION_STEPS }, { size: valueAxisSize, values: valueAxisLabels }],
          series: [
            spec.xLabel ? { label: "version", value: spec.xLabel } : { label: "version" },
            ...spec.series.map(({ label, stroke, width, dash, spanGaps, pointSize }) => ({
              label, stroke, width: width || 1, dash, spanGaps, points: { show: true, size: pointSize || 5 },
              value: (u, value) => (value === null || value === undefined ? "--" : fmt(value)), // 4 significant digits
            })),
          ],
        }, chartData(spec), element);
      } else {
        charts[name].setData(chartData(spec));
      }
    }
    const last = steps.length ? steps[steps.length - 1] : null;
    root.dataset.points = String(steps.length);
    root.dataset.latestVersion = last ? String(last.v) : "";
    document.getElementById("summary").textContent = last
      ? `version ${last.v}: ${minibatchSummary(last)}mean reward ${fmt(last.reward)}, loss ${fmt(last.loss)}${last.minibatch_losses.length ? " (their sum)" : ""}, ${last.used} trajectories, ` +
        `${last.tokens} tokens in ${fmt(last.seconds)} s, learning rate ${last.lr}`
      : "No training step yet.";
  }

  function minibatchSummary(step) {
    const losses = step.minibatch_losses;
    if (!losses.length) return "";
    const plural = losses.length === 1 ? "minibatch" : "minibatches";
    return `${losses.length} ${plural}, minibatch loss ${fmt(losses[0])} → ${fmt(losses[losses.length - 1])}, `;
  }

  function fmt(value) {
    return value === null || value === undefined ? "n/a" : Number(value).toPrecision(4);
  }

  function showModel(model, checkpoints) {
    document.getElementById("sampleable").textContent = model.sampleable_versions.join(", ");
    const body = document.querySelector("#checkpoints tbody");
    body.replaceChildren(...checkpoints.map((c) => {
      const row = document.createElement("tr");
      for (const text of [c.name, c.kind + (c.automatic ? " (automatic)" : ""), String(c.v), c.time || ""]) {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.appendChild(cell);
      }
      return row;
    }));
  }

  async function fetchState(withSteps) {
    const response = await fetch(base + "/state" + (withSteps ? "" : "?steps=false"), { credentials: "same-origin" });
    if (!response.ok) throw new Error("state: HTTP " + response.status);
    return response.json();
  }

  let refreshing = null;
  function refreshModel() {
    // One refresh at a time; events that arrive during one are covered by the next.
    if (refreshing) { refreshing.again = true; return; }
    refreshing = { again: false };
    fetchState(false).then((state) => showModel(state.model, state.checkpoints)).catch(() => {}).finally(() => {
      const again = refreshing.again;
      refreshing = null;
      if (again) refreshModel();
    });
  }

  function setStatus(stream, text) {
    root.dataset.stream = stream;
    document.getElementById("status").textContent = text;
  }

  function follow(fromVersion) {
    const events = new EventSource(base + "/events?from_version=" + fromVersion);
    events.onopen = () => setStatus("open", "live: following the run");
    events.onerror = () => setStatus("connecting", "reconnecting…");
    events.addEventListener("version", (message) => {
      const step = JSON.parse(message.data).step;
      steps = steps.filter((s) => s.v < step.v); // a version after a restore replaces the undone ones
      steps.push(step);
      draw();
      refreshModel();
    });
    events.addEventListener("restored", (message) => {
      const version = JSON.parse(message.data).policy_version;
      steps = steps.filter((s) => s.v <= version);
      draw();
      refreshModel();
    });
    events.addEventListener("checkpoint_saved", refreshModel);
    events.addEventListener("checkpoint_deleted", refreshModel);
    events.addEventListener("deleted", () => { events.close(); setStatus("closed", "the model was deleted"); });
    events.addEventListener("failed", (message) => setStatus("connecting", JSON.parse(message.data).error));
  }

  fetchState(true).then((state) => {
    steps = state.steps;
    const [low, high] = state.mismatch_ratio_bounds;
    CHARTS.mismatch.series[1].label = "fraction of ratios outside [" + low + ", " + high + "]";
    showModel(state.model, state.checkpoints);
    draw();
    follow(steps.length ? steps[steps.length - 1].v + 1 : 0);
  }).catch((error) => setStatus("closed", String(error)));
})();
