// The run view of one model: draws the history from /runs/{model}/state, then follows
// /runs/{model}/events (server-sent events relayed from WatchModel) and redraws without reloading.
// The page's <main id=run> carries data-latest-version, data-points and data-stream for tests, and
// window.runCharts holds the uPlot charts by name.
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
    loss: { title: "Loss (summed over trained tokens)", series: [
      { label: "loss", stroke: "#d9480f", width: 2, value: (s) => s.loss },
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
      { label: "fraction of ratios outside [MISMATCH_RATIO_MIN, MAX]", stroke: "#f783ac", value: (s) => s.ratio_outside },
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

  function chartData(spec) {
    return [steps.map((s) => s.v), ...spec.series.map((series) => steps.map(series.value))];
  }

  function draw() {
    for (const [name, spec] of Object.entries(CHARTS)) {
      const element = document.getElementById("chart-" + name);
      if (!charts[name]) {
        const width = Math.max(element.clientWidth - 12, 300);
        charts[name] = new uPlot({
          title: spec.title, width, height: 240,
          scales: { x: { time: false } },
          axes: [{ label: "policy version", incrs: VERSION_STEPS }, { size: valueAxisSize }],
          series: [{ label: "version" }, ...spec.series.map(({ label, stroke, width, dash }) => ({ label, stroke, width: width || 1, dash, points: { show: true, size: 5 } }))],
        }, chartData(spec), element);
      } else {
        charts[name].setData(chartData(spec));
      }
    }
    const last = steps.length ? steps[steps.length - 1] : null;
    root.dataset.points = String(steps.length);
    root.dataset.latestVersion = last ? String(last.v) : "";
    document.getElementById("summary").textContent = last
      ? `version ${last.v}: mean reward ${fmt(last.reward)}, loss ${fmt(last.loss)}, ${last.used} trajectories, ` +
        `${last.tokens} tokens in ${fmt(last.seconds)} s, learning rate ${last.lr}`
      : "No training step yet.";
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
    showModel(state.model, state.checkpoints);
    draw();
    follow(steps.length ? steps[steps.length - 1].v + 1 : 0);
  }).catch((error) => setStatus("closed", String(error)));
})();
