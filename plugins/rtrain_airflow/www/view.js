/* The Training view of one run (plugins/rtrain_plugin.py serves it and its data).
 *
 * Polls the run's `chart` route (every 3 s while the run is alive, every 20 s after) and its `report`
 * (goodput; every 15 s while alive, once per state after), and draws with uPlot (vendored, www/vendor/uplot).
 * Markers are DOM elements laid over uPlot's plot area at uPlot's own positions (`valToPos`).
 * No inline script or style (the page's Content-Security-Policy forbids both); text goes in as text nodes.
 */
(function () {
  "use strict";

  const body = document.body;
  const API = body.dataset.api;
  const QUERY = body.dataset.query || "";
  const ALIVE = new Set(["pending", "starting", "running", "recovering", "waiting_for_capacity"]);

  // The letter on each kind of marker's flag (the legend under the loss chart says which is which).
  const LETTER = { failure: "F", recovery: "R", resize: "H", rollback: "B", promotion: "P" };
  const TOP_STRIP = 68;
  // Steps and hosts are whole numbers: axis ticks 1, 2, 5, 10, 20, 50, ...
  const STEP_INCRS = [];
  for (let m = 1; m <= 1e9; m *= 10) STEP_INCRS.push(m, 2 * m, 5 * m); // px above each plot for the flags (view.css places one row per kind)

  const state = {
    cursor: null, markers: [], loss: null, hosts: null, status: null,
    lossPlot: null, hostsPlot: null, reportKey: null, reportAt: 0,
  };

  // --- small helpers ---------------------------------------------------------------------------------

  function url(path, extra) {
    let u = API + "/" + path + QUERY;
    if (extra) u += (QUERY ? "&" : "?") + extra;
    return u;
  }

  async function getJSON(path, extra) {
    const r = await fetch(url(path, extra), { credentials: "same-origin", headers: { Accept: "application/json" } });
    let payload = null;
    try { payload = await r.json(); } catch (e) { payload = null; }
    if (!r.ok) {
      const err = new Error((payload && payload.detail) || r.statusText || ("HTTP " + r.status));
      err.status = r.status;
      throw err;
    }
    return payload;
  }

  function h(tag, attrs) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null) continue;
      if (k === "class") el.className = v;
      else if (k === "text") el.textContent = v;
      else if (k.startsWith("data-")) el.dataset[k.slice(5).replace(/-(\w)/g, (_, c) => c.toUpperCase())] = v;
      else el.setAttribute(k, v);
    }
    for (let i = 2; i < arguments.length; i++) {
      const c = arguments[i];
      if (c == null) continue;
      el.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return el;
  }

  const $ = (sel) => document.querySelector(sel);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const num = (x, digits) => (typeof x === "number" ? x.toFixed(digits) : (x == null || x === "" ? "-" : String(x)));
  const clock = (t) => (typeof t === "number" ? new Date(t * 1000).toLocaleTimeString() : "-");
  const seconds = (s) => (typeof s !== "number" ? "-" : s < 120 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min");

  // --- problems (the last data stays on screen) ------------------------------------------------------

  function showProblem(err) {
    const p = $("#problem");
    let text;
    if (err.status === 401 || err.status === 403) {
      text = "Not allowed (" + err.status + "): your Airflow session may have ended; log in to Airflow again and reload.";
    } else if (err.status === 404) {
      text = "The run is not there (404): " + err.message;
    } else if (err.status === 503) {
      text = "The run's storage cannot be read now (503): " + err.message + ". Retrying.";
    } else {
      text = "Cannot reach the server (" + (err.status || err.message) + "). Retrying.";
    }
    p.textContent = text;
    p.hidden = false;
  }

  function clearProblem() {
    $("#problem").hidden = true;
  }

  // --- charts ----------------------------------------------------------------------------------------

  function markersPlugin(key) {
    let layer = null;
    return {
      hooks: {
        init: [(u) => {
          layer = h("div", { class: "rt-markers" });
          u.over.appendChild(layer);
        }],
        draw: [(u) => {
          layer.replaceChildren();
          const width = u.over.clientWidth;
          for (const m of state.markers) {
            const v = m[key];
            if (v == null) continue;
            const left = u.valToPos(v, "x");
            if (!(left >= -1 && left <= width + 1)) continue;
            const el = h("div", { class: "rt-marker rt-marker-" + m.kind, "data-kind": m.kind,
                                  "data-step": m.step == null ? "" : String(m.step) },
                         h("span", { class: "rt-flag", title: m.label, text: LETTER[m.kind] || "?" }));
            el.style.left = left + "px";
            layer.appendChild(el);
          }
        }],
      },
    };
  }

  function pointsOnly(label, color) {
    return { label: label, stroke: color, fill: color, width: 0, paths: () => null,
             points: { show: true, size: 8, space: 0, fill: color, stroke: color } };
  }

  function lossPlot(el) {
    const opts = {
      width: el.clientWidth, height: 300 + TOP_STRIP,
      padding: [TOP_STRIP, null, null, null],
      scales: { x: { time: false } },
      series: [
        { label: "step" },
        { label: "train loss", stroke: css("--train"), width: 1.5, spanGaps: true, points: { show: false } },
        { label: "discarded (trained again)", stroke: css("--discarded"), width: 1, dash: [4, 4], spanGaps: false,
          points: { show: false } },
        pointsOnly("validation loss: validated", css("--validated")),
        pointsOnly("validation loss: rejected", css("--rejected")),
      ],
      axes: [{ label: "step", incrs: STEP_INCRS }, { label: "loss" }],
      plugins: [markersPlugin("step")],
    };
    return new uPlot(opts, lossData(), el);
  }

  function lossData() {
    const l = state.loss;
    return [l.step, l.train, l.discarded, l.validated, l.rejected];
  }

  function hostsPlot(el) {
    const opts = {
      width: el.clientWidth, height: 220 + TOP_STRIP,
      padding: [TOP_STRIP, null, null, null],
      scales: {
        x: { time: true },
        hosts: { range: (u, min, max) => [0, Math.max(2, (max || 0) + 1)] },
        step: {},
      },
      series: [
        {},
        { label: "hosts (mesh)", scale: "hosts", stroke: css("--hosts"), width: 2, spanGaps: true,
          paths: uPlot.paths.stepped({ align: 1 }), points: { show: false },
          value: (u, v, si, i) => (v == null ? "-" : v + " (" + ((state.hosts.mesh || [])[i] || "-") + ")") },
        { label: "step", scale: "step", stroke: css("--steps"), width: 1, spanGaps: true, points: { show: false } },
      ],
      axes: [{}, { scale: "hosts", label: "hosts", incrs: STEP_INCRS },
             { scale: "step", label: "step", side: 1, grid: { show: false }, incrs: STEP_INCRS }],
      plugins: [markersPlugin("time")],
    };
    return new uPlot(opts, hostsData(), el);
  }

  function hostsData() {
    const d = state.hosts;
    return [d.time, d.workers, d.step];
  }

  function drawCharts() {
    const lossEl = $("#loss-chart");
    if (state.loss.step.length === 0) {
      if (!state.lossPlot) lossEl.replaceChildren(h("p", { class: "empty", text: "No step logged yet." }));
    } else if (!state.lossPlot) {
      lossEl.replaceChildren();
      state.lossPlot = lossPlot(lossEl);
    } else {
      state.lossPlot.setData(lossData());
    }
    const hostsEl = $("#hosts-chart");
    if (state.hosts.time.length === 0) {
      if (!state.hostsPlot) hostsEl.replaceChildren(h("p", { class: "empty", text: "No round launched yet." }));
    } else if (!state.hostsPlot) {
      hostsEl.replaceChildren();
      state.hostsPlot = hostsPlot(hostsEl);
    } else {
      state.hostsPlot.setData(hostsData());
    }
  }

  window.addEventListener("resize", () => {
    for (const [plot, el, height] of [[state.lossPlot, "#loss-chart", 300 + TOP_STRIP],
                                     [state.hostsPlot, "#hosts-chart", 220 + TOP_STRIP]]) {
      if (plot) plot.setSize({ width: $(el).clientWidth, height: height });
    }
  });

  // --- the rest of the page --------------------------------------------------------------------------

  function renderStatus(st, latest) {
    const badge = $("#state");
    const s = st ? st.state : "unknown";
    badge.textContent = s;
    badge.className = "badge " + s;
    if (!st) {
      $("#summary").textContent = "The run has no status yet.";
      return;
    }
    const parts = ["step " + num(st.step, 0) + (st.steps_total ? " / " + st.steps_total : "")];
    const loss = st.loss != null ? st.loss : latest && latest.loss;
    if (loss != null) parts.push("loss " + num(loss, 4));
    if (latest && typeof latest.tokens_per_s === "number") parts.push(Math.round(latest.tokens_per_s) + " tokens/s");
    if (st.workers != null) parts.push(st.workers + " hosts");
    if (st.job) parts.push("job " + st.job + (st.failures != null ? " (" + st.failures + " failure(s) absorbed)" : ""));
    if (typeof st.stale_s === "number" && st.stale_s > 15) {
      parts.push("no status update for " + seconds(st.stale_s) + " (the job may be gone)");
    }
    if (st.reason) parts.push(st.reason);
    $("#summary").textContent = parts.join(" · ");
  }

  // The run's place in its storage root's shared pool (submitted runs only), with the scheduler-aware ETA.
  function renderQueue(q) {
    const el = $("#queue");
    if (!q) {
      el.hidden = true;
      return;
    }
    const parts = ["priority " + q.priority, q.state.replace(/_/g, " "),
      q.assigned + " host(s) assigned of " + q.min_hosts + ".." + q.max_hosts];
    if (q.eta_s != null) parts.push("ETA " + seconds(q.eta_s));
    if (q.reason) parts.push(q.reason);
    el.textContent = "In the queue: " + parts.join(" · ") +
      (q.eta_notes && q.eta_notes.length ? " (the ETA assumes: " + q.eta_notes.join("; ") + ")" : "");
    el.hidden = false;
    body.dataset.queueState = q.state;
    if (!state.status) {  // not launched yet: the queue is all there is to say
      $("#state").textContent = q.state;
      $("#state").className = "badge " + q.state;
      $("#summary").textContent = "Not started yet: the pool's scheduler launches it when its hosts are free.";
    }
  }

  function renderRounds(rounds) {
    const tbody = $("#rounds tbody");
    tbody.replaceChildren(...rounds.map((r) => h("tr", {},
      h("td", { text: r.round == null ? "-" : String(r.round) }),
      h("td", { text: clock(r.time) }),
      h("td", { text: r.workers == null ? "-" : String(r.workers) }),
      h("td", { text: r.mesh || "-" }))));
  }

  function renderCheckpoints(cps) {
    const tbody = $("#checkpoints tbody");
    if (!cps.length) {
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: "6", class: "muted", text: "No checkpoint in the ledger yet." })));
      return;
    }
    tbody.replaceChildren(...cps.map((c) => h("tr", { "data-step": String(c.step), "data-state": c.state || "" },
      h("td", { text: String(c.step) }),
      h("td", {}, h("span", { class: "state " + (c.state || ""), text: c.state || "-" })),
      h("td", { class: "muted", text: (c.history || []).join(" → ") }),
      h("td", { text: num(c.loss, 4) }),
      h("td", { text: num(c.accuracy, 3) }),
      h("td", { text: c.reason || "" }))));
  }

  function renderTimeline(items) {
    const ol = $("#timeline");
    ol.replaceChildren(...items.slice().reverse().map((e) => h("li", { class: e.type },
      h("span", { class: "when", text: clock(e.time) }), e.text)));
  }

  function renderGoodput(r) {
    const box = $("#goodput");
    const b = r.breakdown;
    const rec = r.recoveries || [];
    const recText = rec.length
      ? rec.length + " recovery(ies): " + rec.map((x) => (x.cause || "?") + " → " + seconds(x.recovery_s)).join("; ")
      : "no recovery";
    if (!b) {
      box.replaceChildren(
        h("p", { class: "muted", text: "Goodput is computed once the run has ended (it needs the run's wall time)." +
          (r.state && ALIVE.has(r.state) ? " The run is " + r.state + "." : "") }),
        h("p", { text: r.failures + " failure(s), " + recText + "." }));
      return;
    }
    const f = b.fractions;
    const bar = h("div", { class: "goodput-bar", role: "img",
                           "aria-label": "productive " + (f.productive * 100).toFixed(1) + "%" });
    for (const [k, v] of [["productive", f.productive], ["recovery", f.recovery], ["other", f.other]]) {
      const part = h("div", { class: k, title: k + " " + (v * 100).toFixed(1) + "%" });
      part.style.flexBasis = (v * 100).toFixed(3) + "%";
      bar.appendChild(part);
    }
    box.replaceChildren(
      h("p", { class: "goodput-figure", id: "goodput-figure", text: (r.goodput * 100).toFixed(1) + "% goodput" }),
      h("p", { class: "muted", text: "of " + seconds(b.wall_s) + " wall time, from the first launch to the end" }),
      bar,
      h("ul", { class: "goodput-key" },
        h("li", {}, h("span", { class: "swatch productive" }), "steps that count " + seconds(b.productive_s)),
        h("li", {}, h("span", { class: "swatch recovery" }), "recovering " + seconds(b.recovery_s)),
        h("li", {}, h("span", { class: "swatch other" }),
          "start-up, compilation, checkpoints, steps trained again, waiting " + seconds(b.other_s))),
      h("p", { text: r.failures + " failure(s), " + recText + "." }));
  }

  function render(data) {
    state.loss = data.loss;
    state.hosts = data.hosts;
    state.markers = data.markers || [];
    state.status = data.status;
    renderStatus(data.status, data.latest);
    renderQueue(data.queue);
    drawCharts();
    renderRounds(data.rounds || []);
    renderCheckpoints(data.checkpoints || []);
    renderTimeline(data.timeline || []);
    // For people and tests alike: what the page shows now.
    const steps = data.loss.step;
    body.dataset.lastStep = steps.length ? String(steps[steps.length - 1]) : "";
    body.dataset.events = String(data.events);
  }

  async function loadReport(key) {
    state.reportAt = Date.now();
    try {
      const r = await getJSON("report");
      state.reportKey = key;
      renderGoodput(r);
    } catch (err) {
      $("#goodput").replaceChildren(h("p", { class: "muted", text: "The report cannot be read now: " + err.message }));
    }
  }

  // The Stop button: shown while the run has a job to stop (or waits in its pool's queue); it asks as
  // `rtrain stop` does (a pool's run: as `rtrain cancel`), and the run ends "stopped", resumable.
  function renderStop(st, q) {
    const live = !!(st && ALIVE.has(st.state)) || !!(q && (q.state === "queued" || ALIVE.has(q.state)));
    const button = $("#stop");
    button.hidden = !live;
    body.dataset.stoppable = String(live);
  }

  async function stopRun() {
    if (!window.confirm("Stop this run? Its job ends stopped (not failed); a new run of it resumes from its newest committed checkpoint.")) return;
    const button = $("#stop");
    const said = $("#stop-said");
    button.disabled = true;
    try {
      const r = await fetch(url("stop"), { method: "POST", credentials: "same-origin", headers: { Accept: "application/json" } });
      let payload = null;
      try { payload = await r.json(); } catch (e) { payload = null; }
      if (!r.ok) throw new Error((payload && payload.detail) || r.statusText || ("HTTP " + r.status));
      said.textContent = payload.asked === "cancel"
        ? "Cancelled in the queue: its job stops at the scheduler's next look."
        : "Asked the job to stop: it ends stopped at its leader's next look.";
    } catch (err) {
      said.textContent = "The run could not be stopped: " + err.message;
      button.disabled = false;
    }
    said.hidden = false;
  }

  $("#stop").addEventListener("click", stopRun);

  async function tick() {
    let delay = 10000;
    try {
      const data = await getJSON("chart", state.cursor ? "since=" + encodeURIComponent(state.cursor) : "");
      clearProblem();
      if (data.unchanged) {
        state.status = data.status;
        renderStatus(data.status, null);
        renderQueue(data.queue);
      } else {
        render(data);
      }
      state.cursor = data.cursor;
      const st = state.status;
      const alive = !!(st && ALIVE.has(st.state));
      renderStop(st, data.queue);
      const key = st ? st.state + ":" + (st.job || "") : "none";
      if (state.reportKey !== key ? Date.now() - state.reportAt > 3000 : alive && Date.now() - state.reportAt > 15000) {
        await loadReport(key);
      }
      body.dataset.loaded = "true";
      delay = alive ? 3000 : 20000;
    } catch (err) {
      showProblem(err);
    }
    if (document.hidden) delay = Math.max(delay, 30000);
    window.setTimeout(tick, delay);
  }

  tick();
})();
