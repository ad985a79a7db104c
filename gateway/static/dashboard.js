// The KV dashboard: reads /dashboard/events (server-sent events over fetch, so an API key can go in
// the Authorization header) and draws each worker's block pools, figures, requests and charts.
// Frames: "worker" (a worker's snapshot, worker/core/scheduling/kv_snapshot.py) and "gateway" (latencies, queue).
// The canvases (pool grids, line charts) are drawn by draw.js.
"use strict";

(() => {
  const { HISTORY_S, chart, drawPool } = Draw;
  const state = { workers: new Map(), gateway: [], selected: null, frames: 0, key: sessionStorage.getItem("pagedserve-key") || "" };
  window.dashboard = state; // for the browser test and for curious operators

  // ------------------------------------------------------------------ the feed
  async function connect() {
    const status = document.getElementById("status");
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    let response;
    try {
      response = await fetch("/dashboard/events", { headers });
    } catch (err) {
      return retry(status, "gateway unreachable");
    }
    if (response.status === 401) {
      status.textContent = state.key ? "wrong API key" : "API key needed";
      document.getElementById("key-form").hidden = false;
      return;
    }
    if (!response.ok) return retry(status, "feed refused: HTTP " + response.status);
    status.textContent = "live";
    status.className = "status live";
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (err) {
        break;
      }
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        handleFrame(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
    retry(status, "feed ended");
  }

  function retry(status, why) {
    status.textContent = why + "; reconnecting…";
    status.className = "status";
    setTimeout(connect, 2000);
  }

  function handleFrame(text) {
    let event = "message", data = "";
    for (const line of text.split("\n")) {
      if (line.startsWith("event: ")) event = line.slice(7);
      else if (line.startsWith("data: ")) data += line.slice(6);
    }
    if (!data) return; // a keepalive comment
    state.frames += 1;
    const payload = JSON.parse(data);
    if (event === "worker") onWorker(payload);
    else if (event === "gateway") onGateway(payload);
  }

  document.getElementById("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.key = document.getElementById("key").value;
    sessionStorage.setItem("pagedserve-key", state.key);
    document.getElementById("key-form").hidden = true;
    connect();
  });

  // ------------------------------------------------------------------ data
  function decodePool(encoded) {
    const cells = new Uint8Array(encoded[0]);
    let at = 0;
    for (let i = 2; i < encoded.length; i += 2) {
      cells.fill(Math.min(255, encoded[i]), at, at + encoded[i + 1]);
      at += encoded[i + 1];
    }
    return { cells, group: encoded[1] };
  }

  function onWorker(snap) {
    let w = state.workers.get(snap.worker);
    if (!w) {
      w = { name: snap.worker, history: [], view: makeWorkerView(snap.worker) };
      state.workers.set(snap.worker, w);
    }
    const prev = w.history[w.history.length - 1];
    const f = snap.figures;
    const point = { t: snap.time, tokens: snap.tokens_out, cow: f.cow_copies, preemptions: f.preemptions,
                    hits: f.prefix_hit_tokens, queries: f.prefix_query_tokens, waiting: f.waiting, kv: f.total ? 100 * f.used / f.total : 0 };
    if (prev && point.t > prev.t) {
      point.tokensPerS = Math.max(0, (point.tokens - prev.tokens) / (point.t - prev.t));
      point.cowPerS = Math.max(0, (point.cow - prev.cow) / (point.t - prev.t));
    }
    w.history.push(point);
    while (w.history.length && w.history[0].t < point.t - HISTORY_S) w.history.shift();
    w.snap = snap;
    w.gpu = decodePool(snap.gpu);
    w.cpu = decodePool(snap.cpu);
    w.holders = holders(snap);
    w.seen = Date.now();
    drawWorker(w);
    drawRequests();
    drawCharts();
  }

  function onGateway(g) {
    state.gateway.push(g);
    while (state.gateway.length && state.gateway[0].time < g.time - HISTORY_S) state.gateway.shift();
    for (const [name, w] of state.workers) { // a worker gone quiet leaves the page
      if (Date.now() - w.seen > 10000) { w.view.root.remove(); state.workers.delete(name); }
    }
    drawCharts();
  }

  // Each sequence's tables, every lane's (a hybrid model: docs/engine.md, "Lanes"): [seq, lane, table].
  function laneTables(row) {
    return row.tables.flatMap((table, seq) => [table, ...((row.lane_tables || [])[seq] || [])].map((t, lane) => [seq, lane, t]));
  }

  function laneName(snap, lane) {
    const windows = snap.lanes || [0];
    return windows.length < 2 ? "" : windows[lane] ? ` · lane ${lane} (window ${windows[lane]})` : ` · lane ${lane} (full)`;
  }

  function holders(snap) {
    const held = { gpu: new Map(), cpu: new Map() };
    for (const row of snap.requests) {
      for (const [seq, lane, table] of laneTables(row)) {
        for (const block of table) {
          if (block < 0 || !row.device) continue;
          const map = held[row.device];
          if (!map.has(block)) map.set(block, []);
          map.get(block).push(row.id + (row.tables.length > 1 ? " #" + seq : "") + laneName(snap, lane));
        }
      }
    }
    return held;
  }

  // ------------------------------------------------------------------ a worker: pools and figures
  function makeWorkerView(name) {
    const empty = document.querySelector("#workers .empty");
    if (empty) empty.remove();
    const root = document.createElement("article");
    root.className = "worker";
    root.innerHTML = `<h2></h2><div class="pools"><canvas class="gpu"></canvas><p class="gpu-caption"></p>
      <canvas class="cpu"></canvas><p class="cpu-caption"></p></div><dl class="figures"></dl>
      <figure class="paging"><figcaption>The running requests' KV memory, in blocks</figcaption><div class="bars"></div></figure>`;
    root.querySelector("h2").textContent = "worker " + name;
    document.getElementById("workers").appendChild(root);
    const view = { root, gpu: root.querySelector("canvas.gpu"), cpu: root.querySelector("canvas.cpu"),
                   figures: root.querySelector(".figures") };
    view.gpu.addEventListener("mousemove", (e) => hover(e, name, "gpu"));
    view.cpu.addEventListener("mousemove", (e) => hover(e, name, "cpu"));
    for (const c of [view.gpu, view.cpu]) c.addEventListener("mouseleave", () => { tooltip().hidden = true; });
    return view;
  }

  function drawWorker(w) {
    const f = w.snap.figures, last = w.history[w.history.length - 1];
    drawPool(w.view.gpu, w.gpu, "gpu");
    drawPool(w.view.cpu, w.cpu, "cpu");
    const per = (pool) => (pool.group > 1 ? ` (a cell: ${pool.group} blocks, its most shared)` : "");
    const cache = w.snap.kv_cache_dtype ? ` · KV ${w.snap.kv_cache_dtype}, ${w.snap.kv_bytes_per_token} bytes a token` : "";
    w.view.root.querySelector(".gpu-caption").textContent = `GPU pool: ${f.total} blocks of ${w.snap.block_size} tokens${per(w.gpu)}` +
      `${cache} · snapshot taken in ${w.snap.took_ms} ms`;
    w.view.root.querySelector(".cpu-caption").textContent = f.cpu_total ? `CPU pool (swap): ${f.cpu_total} blocks${per(w.cpu)}` : "no CPU swap space";
    const windowed = w.history.find((p) => p.t >= last.t - 10) || last;
    const recentQueries = last.queries - windowed.queries;
    const rows = [
      ["utilisation", pct(f.used, f.total)],
      ["saved by sharing", f.logical ? pct(f.logical - f.used, f.logical) : "–"],
      ["prefix hit rate", pct(f.prefix_hit_tokens, f.prefix_query_tokens)],
      ["… last 10 s", recentQueries > 0 ? pct(last.hits - windowed.hits, recentQueries) : "–"],
      ["preemptions", f.preemptions],
      ["CoW copies/s", (last.cowPerS || 0).toFixed(1)],
      ["tokens/s", (last.tokensPerS || 0).toFixed(1)],
      ["running · waiting · swapped", `${f.running} · ${f.waiting} · ${f.swapped}`],
      ["cached blocks", f.cached],
      ["queue (model's stream)", w.snap.queue_depth],
    ];
    if (f.host_total !== undefined) rows.push(["host tier", `${f.host_used} / ${f.host_total} blocks`]);
    if (f.disk_max_bytes !== undefined) rows.push(["disk tier", `${(f.disk_bytes / 2 ** 20).toFixed(1)} / ${(f.disk_max_bytes / 2 ** 20).toFixed(0)} MiB`]);
    if (f.tier_hit_tokens !== undefined) rows.push(["prompt tokens from the tiers", f.tier_hit_tokens]);
    if (f.spec_draft_tokens !== undefined) rows.push(["drafted tokens kept", `${f.spec_accepted_tokens} / ${f.spec_draft_tokens} (${pct(f.spec_accepted_tokens, f.spec_draft_tokens)})`]);
    drawPaging(w.view.root.querySelector(".paging .bars"), f);
    w.view.figures.innerHTML = "";
    for (const [name, value] of rows) {
      const dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = value;
      dd.dataset.figure = name;
      w.view.figures.append(dt, dd);
    }
  }

  // What the seed's picture shows: contiguous max-length slots against pages, and what sharing saves.
  function drawPaging(bars, f) {
    const grouped = f.one_table !== undefined;  // a hybrid model: a table per lane of layers
    const rows = [
      ["without paging", f.unpaged, "a contiguous slot per sequence for prompt + max_tokens, from admission"],
      ...(grouped ? [["paged, one table", f.one_table, "the blocks the tables would name if every layer kept every position"]] : []),
      [grouped ? "paged per group" : "paged", f.logical,
       grouped ? "the blocks the lanes' tables name: a sliding lane only its window" : "the blocks the tables name: each sequence's own, as written so far"],
      [grouped ? "per group and shared" : "paged and shared", f.used, "the blocks held: copy-on-write and the prefix cache share the rest"],
    ];
    const most = Math.max(1, ...rows.map((r) => r[1] || 0));
    bars.innerHTML = "";
    for (const [name, blocks, what] of rows) {
      const row = document.createElement("div"), bar = document.createElement("span"), label = document.createElement("b");
      row.className = "bar";
      row.title = what;
      row.dataset.figure = name;
      label.textContent = `${name}: ${blocks ?? "–"}`;
      bar.style.width = `${(100 * (blocks || 0)) / most}%`;
      row.append(label, bar);
      bars.append(row);
    }
    const saved = document.createElement("p");
    saved.textContent = !f.unpaged ? "no request running" : grouped
      ? `paging saves ${pct(f.unpaged - f.one_table, f.unpaged)} of the reserved blocks, groups ${pct(f.one_table - f.logical, f.one_table)} ` +
        `of the paged ones, sharing ${pct(f.logical - f.used, f.logical)} of the rest`
      : `paging saves ${pct(f.unpaged - f.logical, f.unpaged)} of the reserved blocks, sharing ${pct(f.logical - f.used, f.logical)} of the paged ones`;
    bars.append(saved);
  }

  function pct(part, whole) {
    return whole ? (100 * part / whole).toFixed(1) + " %" : "–";
  }

  function tooltip() {
    return document.getElementById("tooltip");
  }

  function hover(e, name, device) {
    const w = state.workers.get(name), canvas = e.target, pool = w[device];
    const size = +canvas.dataset.cellSize, cols = +canvas.dataset.cols;
    const cell = Math.floor(e.offsetY / size) * cols + Math.floor(e.offsetX / size);
    const tip = tooltip();
    if (cell < 0 || cell >= pool.cells.length || Math.floor(e.offsetX / size) >= cols) { tip.hidden = true; return; }
    const value = pool.cells[cell], first = cell * pool.group, last = first + pool.group - 1;
    const what = value === 0 ? "free" : value === 1 ? "cached, evictable" : `refcount ${value - 1}` + (value > 2 ? " (shared)" : "");
    const who = [];
    for (let b = first; b <= last; b++) (w.holders[device].get(b) || []).forEach((h) => who.push(h));
    tip.textContent = `${device.toUpperCase()} block${pool.group > 1 ? `s ${first}–${last}` : " " + first}: ${what}` +
      (who.length ? ` · held by ${[...new Set(who)].slice(0, 8).join(", ")}${who.length > 8 ? " …" : ""}` : "");
    tip.style.left = e.clientX + 14 + "px";
    tip.style.top = e.clientY + 14 + "px";
    tip.hidden = false;
  }

  // ------------------------------------------------------------------ requests and a block table
  function drawRequests() {
    const body = document.querySelector("#requests tbody");
    body.innerHTML = "";
    let unlisted = 0;
    for (const w of state.workers.values()) {
      unlisted += w.snap.unlisted;
      for (const row of w.snap.requests) {
        const tr = document.createElement("tr");
        const seqs = row.tables.length || 1;
        for (const v of [row.id, w.name, row.state, seqs, row.blocks, row.prompt, row.generated, row.age.toFixed(1)]) {
          const td = document.createElement("td");
          td.textContent = v;
          tr.appendChild(td);
        }
        if (state.selected && state.selected.id === row.id) tr.className = "selected";
        tr.addEventListener("click", () => { state.selected = { id: row.id, worker: w.name }; drawRequests(); });
        body.appendChild(tr);
      }
    }
    document.getElementById("unlisted").textContent = unlisted ? `(${unlisted} more not listed)` : "";
    drawBlockTable();
  }

  function drawBlockTable() {
    const box = document.getElementById("block-table");
    const w = state.selected && state.workers.get(state.selected.worker);
    const row = w && w.snap.requests.find((r) => r.id === state.selected.id);
    if (!state.selected) return;
    if (!row) {
      box.innerHTML = "<p class='empty'></p>";
      box.firstChild.textContent = `${state.selected.id} is no longer listed (finished, or past the listing's limit).`;
      return;
    }
    box.innerHTML = "";
    const title = document.createElement("p");
    title.textContent = `${row.id}: ${row.state}, ${row.blocks} blocks` + (row.device ? ` on the ${row.device.toUpperCase()}` : ", none held") +
      (row.cut ? " (tables cut short)" : "");
    box.appendChild(title);
    const pool = row.device && w[row.device];
    for (const [seq, lane, table] of laneTables(row)) {
      const line = document.createElement("div");
      line.className = "seq";
      line.innerHTML = "<b></b>";
      line.firstChild.textContent = `seq ${seq}${laneName(w.snap, lane)}`;
      for (const block of table) {
        const cell = document.createElement("span");
        const value = block >= 0 && pool ? pool.cells[Math.floor(block / pool.group)] : 0;
        cell.className = "blk" + (block < 0 ? " released" : value > 2 ? " shared" : "") + (row.device === "cpu" ? " cpu" : "");
        cell.textContent = block < 0 ? "–" : block;
        cell.title = block < 0 ? "released (outside the sliding window)" : `block ${block}` + (value > 2 ? `, shared by ${value - 1}` : "");
        line.appendChild(cell);
      }
      box.appendChild(line);
    }
  }

  // ------------------------------------------------------------------ charts
  function drawCharts() {
    const workers = [...state.workers.values()];
    const g = state.gateway;
    chart("chart-throughput", workers.map((w) => ({ name: w.name, points: w.history.filter((p) => p.tokensPerS !== undefined).map((p) => [p.t, p.tokensPerS]) })));
    chart("chart-kv", workers.map((w) => ({ name: w.name, points: w.history.map((p) => [p.t, p.kv]) })));
    for (const [id, key] of [["chart-ttft", "ttft_ms"], ["chart-itl", "itl_ms"]]) {
      chart(id, ["p50", "p90", "p99", "max"].map((q) => ({ name: q, points: g.filter((x) => x[key].count).map((x) => [x.time, x[key][q]]) })));
    }
    chart("chart-queue", [{ name: "model's stream", points: g.filter((x) => x.queue_depth !== null).map((x) => [x.time, x.queue_depth]) }]
      .concat(workers.map((w) => ({ name: "waiting " + w.name, points: w.history.map((p) => [p.t, p.waiting]) }))));
  }

  connect();
})();
