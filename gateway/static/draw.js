// Drawing for the KV dashboard (dashboard.js): block pools as grids of cells and line charts over
// time, on canvases, with no library.
"use strict";

const Draw = (() => {
  const HISTORY_S = 300; // the charts show at most the last five minutes
  const COLORS = { free: "#e6e6e6", cached: "#9ecae1", owned: "#41ab5d", swapped: "#756bb1" };
  const SHARED = ["#fdae6b", "#fd8d3c", "#e6550d", "#d94801", "#a63603", "#7f2704"]; // 2, 3, … sharers
  const LINES = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2"];

  function cellColor(value, device) {
    if (value === 0) return COLORS.free;
    if (device === "cpu") return COLORS.swapped;
    if (value === 1) return COLORS.cached;
    if (value === 2) return COLORS.owned;
    return SHARED[Math.min(SHARED.length - 1, value - 3)];
  }

  function layout(count, width) {
    const size = Math.max(3, Math.min(16, Math.floor(Math.sqrt((width * 260) / Math.max(1, count)))));
    const cols = Math.max(1, Math.floor(width / size));
    return { size, cols, rows: Math.ceil(count / cols) };
  }

  function drawPool(canvas, pool, device) {
    const { size, cols, rows } = layout(pool.cells.length, 520);
    canvas.width = cols * size;
    canvas.height = Math.max(1, rows * size);
    canvas.hidden = pool.cells.length === 0;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const gap = size > 4 ? 1 : 0;
    pool.cells.forEach((value, i) => {
      ctx.fillStyle = cellColor(value, device);
      ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    });
    canvas.dataset.cellSize = size;
    canvas.dataset.cols = cols;
  }

  function chart(id, series) {
    const canvas = document.getElementById(id), ctx = canvas.getContext("2d");
    const W = canvas.width, H = canvas.height, left = 44, bottom = 18, top = 6, right = 8;
    ctx.clearRect(0, 0, W, H);
    const all = series.flatMap((s) => s.points);
    const now = all.length ? Math.max(...all.map((p) => p[0])) : Date.now() / 1000;
    const ymax = niceMax(Math.max(0, ...all.map((p) => p[1])));
    const span = all.length ? now - Math.min(...all.map((p) => p[0])) : 0;
    const shown = Math.min(HISTORY_S, Math.max(60, span)); // a minute at least, five at most
    const x = (t) => left + (W - left - right) * (1 - (now - t) / shown);
    const y = (v) => H - bottom - (H - bottom - top) * (v / ymax);
    ctx.font = "10px system-ui, sans-serif";
    ctx.strokeStyle = "#e5e7eb";
    ctx.fillStyle = "#6b7280";
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4;
      ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(W - right, y(v)); ctx.stroke();
      ctx.fillText(v >= 100 ? v.toFixed(0) : v.toPrecision(2), 2, y(v) + 3);
    }
    ctx.fillText(shown >= 120 ? `−${Math.round(shown / 60)} min` : `−${Math.round(shown)} s`, left, H - 4);
    ctx.fillText("now", W - right - 18, H - 4);
    series.forEach((s, i) => {
      ctx.strokeStyle = LINES[i % LINES.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      s.points.forEach(([t, v], j) => (j ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
      ctx.stroke();
      ctx.fillStyle = LINES[i % LINES.length];
      if (s.points.length < 40) s.points.forEach(([t, v]) => ctx.fillRect(x(t) - 1.5, y(v) - 1.5, 3, 3)); // a lone point shows
      ctx.fillText(s.name, left + 6 + i * 80, top + 10);
    });
    canvas.dataset.points = all.length;
    canvas.dataset.max = Math.max(0, ...all.map((p) => p[1]));
  }

  function niceMax(v) {
    if (v <= 0) return 1;
    const step = Math.pow(10, Math.floor(Math.log10(v)));
    return [1, 2, 5, 10].map((m) => m * step).find((m) => m >= v);
  }

  return { HISTORY_S, chart, drawPool };
})();
