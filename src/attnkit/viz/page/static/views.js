/* attnkit views: head, model, neuron and next-token views of one recording.
   One bundled script, no network: everything the page needs is in its data block.
   window.attnkitViewsInit(id) wires the element with that id; window.attnkitViews[id]
   is its API (used by the tests): show(view), svg(view), png(view), distribution(),
   step(), reset(). */
(function () {
  "use strict";
  if (window.attnkitViewsInit) return;
  const SVGNS = "http://www.w3.org/2000/svg";
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const HEAD_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e", "#393b79", "#637939"];
  const MIN_LINE = 0.005; // head view: lines of smaller weight are not drawn

  function viridis(x) {
    x = Math.max(0, Math.min(1, x)) * (VIRIDIS.length - 1);
    const i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
    return VIRIDIS[i].map((v, j) => Math.round(v + (VIRIDIS[i + 1][j] - v) * f));
  }
  function luminance(rgb) {
    const c = rgb.map(v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); });
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
  }
  function textOn(rgb) { // black or white, whichever contrasts more (WCAG)
    const y = luminance(rgb);
    return (y + 0.05) / 0.05 >= 1.05 / (y + 0.05) ? "#000" : "#fff";
  }
  function css(rgb) { return "rgb(" + rgb.join(",") + ")"; }
  function bytes(b64) {
    const bin = atob(b64), u = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) u[i] = bin.charCodeAt(i);
    return u.buffer;
  }
  function el(tag, attrs, kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else if (k === "cls") e.className = v; else e.setAttribute(k, v);
    }
    (kids || []).forEach(c => e.appendChild(c));
    return e;
  }
  function fmt(x, n) { return (x >= 0 ? "" : "\u2212") + Math.abs(x).toFixed(n); }

  /* ---- scenes: lists of primitives drawn as SVG (display, export) or on a canvas (PNG) ---- */
  function sceneToSvg(scene) {
    const s = document.createElementNS(SVGNS, "svg");
    s.setAttribute("xmlns", SVGNS);
    s.setAttribute("width", scene.w); s.setAttribute("height", scene.h);
    s.setAttribute("viewBox", "0 0 " + scene.w + " " + scene.h);
    s.setAttribute("role", "img"); s.setAttribute("aria-label", scene.label);
    s.setAttribute("font-family", "system-ui, sans-serif");
    const bg = document.createElementNS(SVGNS, "rect");
    bg.setAttribute("width", scene.w); bg.setAttribute("height", scene.h); bg.setAttribute("fill", "#fff");
    s.appendChild(bg);
    for (const p of scene.items) {
      let e;
      if (p.k === "line") {
        e = document.createElementNS(SVGNS, "line");
        for (const a of ["x1", "y1", "x2", "y2"]) e.setAttribute(a, p[a].toFixed(1));
        e.setAttribute("stroke", p.stroke); e.setAttribute("stroke-width", p.width || 1.5);
        e.setAttribute("stroke-opacity", p.opacity.toFixed(3));
      } else if (p.k === "rect") {
        e = document.createElementNS(SVGNS, "rect");
        for (const a of ["x", "y"]) e.setAttribute(a, p[a].toFixed(1));
        e.setAttribute("width", Math.max(0, p.w).toFixed(1)); e.setAttribute("height", p.h.toFixed(1));
        e.setAttribute("fill", p.fill);
        if (p.stroke) e.setAttribute("stroke", p.stroke);
      } else if (p.k === "text") {
        e = document.createElementNS(SVGNS, "text");
        e.setAttribute("x", p.x.toFixed(1)); e.setAttribute("y", p.y.toFixed(1));
        e.setAttribute("font-size", p.size || 12); e.setAttribute("fill", p.fill || "#222");
        e.setAttribute("text-anchor", p.anchor || "start");
        e.setAttribute("dominant-baseline", "middle");
        if (p.bold) e.setAttribute("font-weight", "700");
        if (p.cls) e.setAttribute("class", p.cls);
        e.textContent = p.s;
      } else if (p.k === "img") {
        e = document.createElementNS(SVGNS, "image");
        e.setAttribute("x", p.x); e.setAttribute("y", p.y); e.setAttribute("width", p.w); e.setAttribute("height", p.h);
        e.setAttribute("href", p.canvas.toDataURL("image/png"));
        e.setAttribute("style", "image-rendering:pixelated");
      }
      if (p.cls && p.k !== "text") e.setAttribute("class", p.cls);
      s.appendChild(e);
    }
    return s;
  }
  function sceneToCanvas(scene, ratio) {
    ratio = ratio || 2;
    const c = document.createElement("canvas");
    c.width = Math.ceil(scene.w * ratio); c.height = Math.ceil(scene.h * ratio);
    const g = c.getContext("2d");
    g.scale(ratio, ratio);
    g.fillStyle = "#fff"; g.fillRect(0, 0, scene.w, scene.h);
    g.textBaseline = "middle";
    for (const p of scene.items) {
      if (p.k === "line") {
        g.globalAlpha = p.opacity; g.strokeStyle = p.stroke; g.lineWidth = p.width || 1.5;
        g.beginPath(); g.moveTo(p.x1, p.y1); g.lineTo(p.x2, p.y2); g.stroke(); g.globalAlpha = 1;
      } else if (p.k === "rect") {
        g.fillStyle = p.fill; g.fillRect(p.x, p.y, Math.max(0, p.w), p.h);
        if (p.stroke) { g.strokeStyle = p.stroke; g.lineWidth = 1; g.strokeRect(p.x, p.y, p.w, p.h); }
      } else if (p.k === "text") {
        g.fillStyle = p.fill || "#222";
        g.font = (p.bold ? "700 " : "") + (p.size || 12) + "px system-ui, sans-serif";
        g.textAlign = p.anchor === "middle" ? "center" : p.anchor === "end" ? "right" : "left";
        g.fillText(p.s, p.x, p.y);
      } else if (p.k === "img") {
        g.imageSmoothingEnabled = false; g.drawImage(p.canvas, p.x, p.y, p.w, p.h);
      }
    }
    return c;
  }
  function download(name, href, root) {
    const a = el("a", { href: href, download: name });
    a.style.display = "none"; root.appendChild(a); a.click(); a.remove();
  }

  window.attnkitViews = window.attnkitViews || {};
  window.attnkitViewsInit = function (id) {
    const root = document.getElementById(id);
    const D = JSON.parse(root.querySelector("script.akp-data").textContent);
    const T = D.tokens.length, L = D.layers.length, H = D.heads;
    const $ = s => root.querySelector(s);

    /* ---- weights: uint16 fixed point (w * 65535), lower triangle only when causal ---- */
    const cache = {};
    function weights(l) { // Float32Array (H, qn, T)
      if (cache[l]) return cache[l];
      const layer = D.layers[l], qn = layer.qn, off = T - qn;
      const raw = new Uint16Array(bytes(layer.w)), out = new Float32Array(H * qn * T);
      let n = 0;
      for (let h = 0; h < H; h++) for (let i = 0; i < qn; i++) {
        const len = layer.tri ? i + off + 1 : T, base = (h * qn + i) * T;
        for (let j = 0; j < len; j++) out[base + j] = raw[n++] / 65535;
      }
      return (cache[l] = out);
    }
    function w(l, h, i, j) { const qn = D.layers[l].qn; return weights(l)[(h * qn + i) * T + j]; }
    const qk = D.qk ? {
      q: D.qk.q.map(b => new Float32Array(bytes(b))), k: D.qk.k.map(b => new Float32Array(bytes(b))),
    } : null;

    function fillSelect(sel, labels, value) {
      sel.innerHTML = "";
      labels.forEach((t, i) => sel.appendChild(el("option", { value: String(i), text: t })));
      sel.value = String(value || 0);
    }
    const layerNames = D.layers.map((_, i) => "layer " + i);
    const tokNames = D.tokens.map((t, i) => i + ": " + t);

    /* ---- head view: lines from each query token (left) to each key token (right) ---- */
    const hv = {
      layer: $(".akp-head-layer"), query: $(".akp-head-query"), heads: $(".akp-head-heads"),
      out: $(".akp-head-out"), note: $(".akp-head-note"),
    };
    fillSelect(hv.layer, layerNames, 0);
    hv.query.appendChild(el("option", { value: "all", text: "every query" }));
    D.tokens.slice(T - D.layers[0].qn).forEach((t, i) =>
      hv.query.appendChild(el("option", { value: String(i), text: (T - D.layers[0].qn + i) + ": " + t })));
    const headBoxes = [];
    for (let h = 0; h < H; h++) {
      const box = el("input", { type: "checkbox", id: id + "-hv-h" + h, value: String(h) });
      box.checked = H <= 4 || h === 0; // many heads at once blur into one another
      const sw = el("span", { cls: "akp-swatch" }); sw.style.background = HEAD_COLOURS[h % HEAD_COLOURS.length];
      hv.heads.appendChild(el("label", { for: id + "-hv-h" + h, cls: "akp-check" }, [box, sw, document.createTextNode("head " + h)]));
      headBoxes.push(box);
    }
    function headScene() {
      const l = +hv.layer.value, qn = D.layers[l].qn, off = T - qn;
      const chosen = headBoxes.filter(b => b.checked).map(b => +b.value);
      const qsel = hv.query.value === "all" ? null : +hv.query.value;
      const longest = Math.max(...D.tokens.map(t => t.length));
      const lw = Math.min(170, 14 + 7 * longest), gap = 220, row = 18, top = 46;
      const title = "layer " + l + " \u00b7 " + (chosen.length ? (chosen.length > 1 ? "heads " : "head ") + chosen.join(", ") : "no head chosen");
      const W = Math.max(2 * lw + gap + 20, 20 + 7.5 * title.length), Hgt = top + T * row + 12;
      const xl = 10 + lw, xr = xl + gap, items = [];
      items.push({ k: "text", x: 10, y: 14, s: title, size: 13, bold: true });
      items.push({ k: "text", x: xl - 4, y: 34, s: "query", anchor: "end", size: 11, fill: "#555" });
      items.push({ k: "text", x: xr + 4, y: 34, s: "key", size: 11, fill: "#555" });
      let lines = 0;
      const qs = qsel === null ? [...Array(qn).keys()] : [qsel];
      for (const h of chosen) {
        const colour = HEAD_COLOURS[h % HEAD_COLOURS.length];
        const alpha = chosen.length > 1 ? 0.85 : 1;
        for (const i of qs) for (let j = 0; j < T; j++) {
          const v = w(l, h, i, j);
          if (v < MIN_LINE) continue;
          items.push({ k: "line", x1: xl, y1: top + (i + off) * row + row / 2, x2: xr, y2: top + j * row + row / 2,
            stroke: colour, opacity: Math.min(1, v) * alpha, width: 1 + 3 * v, cls: "akp-line" });
          lines++;
        }
      }
      D.tokens.forEach((t, i) => {
        const hl = qsel !== null && i === qsel + off;
        if (hl) items.push({ k: "rect", x: 6, y: top + i * row + 1, w: lw, h: row - 2, fill: "#fde9c8" });
        items.push({ k: "text", x: xl - 4, y: top + i * row + row / 2, s: t, anchor: "end", bold: hl });
        items.push({ k: "text", x: xr + 4, y: top + i * row + row / 2, s: t });
      });
      return { w: W, h: Hgt, items, lines, label: "head view: attention lines from query tokens to key tokens, layer " + l };
    }
    function drawHead() {
      const scene = headScene();
      hv.out.innerHTML = ""; hv.out.appendChild(sceneToSvg(scene));
      hv.note.textContent = scene.lines + " lines (weight \u2265 " + MIN_LINE + "; opacity and width grow with the weight)";
    }
    [hv.layer, hv.query].forEach(s => s.addEventListener("change", drawHead));
    root.querySelectorAll(".akp-heads-all, .akp-heads-none").forEach(b => b.addEventListener("click", () => {
      headBoxes.forEach(x => { x.checked = b.classList.contains("akp-heads-all"); });
      drawHead();
    }));
    headBoxes.forEach(b => b.addEventListener("change", drawHead));

    /* ---- model view: layers x heads thumbnails; a click opens that head in the head view ---- */
    const mv = { grid: $(".akp-model-grid") };
    const thumbs = [];
    function thumb(l, h) {
      const qn = D.layers[l].qn, c = el("canvas", { width: T, height: qn, "aria-hidden": "true" });
      const g = c.getContext("2d"), img = g.createImageData(T, qn);
      let vmax = 0;
      for (let i = 0; i < qn; i++) for (let j = 0; j < T; j++) vmax = Math.max(vmax, w(l, h, i, j));
      vmax = vmax || 1;
      for (let i = 0; i < qn; i++) for (let j = 0; j < T; j++) {
        const v = w(l, h, i, j), p = 4 * (i * T + j);
        const rgb = v === 0 ? [236, 236, 236] : viridis(v / vmax);
        img.data[p] = rgb[0]; img.data[p + 1] = rgb[1]; img.data[p + 2] = rgb[2]; img.data[p + 3] = 255;
      }
      g.putImageData(img, 0, 0);
      return c;
    }
    function drawModel() {
      if (thumbs.length) return;
      const table = el("table", { cls: "akp-model" });
      const head = el("tr", {}, [el("th", { scope: "col", text: "layer \\ head" })]);
      for (let h = 0; h < H; h++) head.appendChild(el("th", { scope: "col", text: "head " + h }));
      table.appendChild(el("thead", {}, [head]));
      const body = el("tbody");
      for (let l = 0; l < L; l++) {
        const tr = el("tr", {}, [el("th", { scope: "row", text: "layer " + l })]);
        thumbs.push([]);
        for (let h = 0; h < H; h++) {
          const c = thumb(l, h);
          thumbs[l].push(c);
          const b = el("button", { type: "button", cls: "akp-thumb", "aria-label": "open layer " + l + " head " + h + " in the head view", "data-layer": l, "data-head": h }, [c]);
          b.addEventListener("click", () => openHead(l, h));
          tr.appendChild(el("td", {}, [b]));
        }
        body.appendChild(tr);
      }
      table.appendChild(body);
      mv.grid.innerHTML = ""; mv.grid.appendChild(table);
    }
    function modelScene() {
      drawModel();
      const cell = 64, pad = 8, left = 70, top = 40, items = [];
      items.push({ k: "text", x: 10, y: 14, s: "model view: " + L + " layers \u00d7 " + H + " heads", size: 13, bold: true });
      for (let h = 0; h < H; h++) items.push({ k: "text", x: left + h * (cell + pad) + cell / 2, y: top - 10, s: "head " + h, anchor: "middle", size: 11 });
      for (let l = 0; l < L; l++) {
        items.push({ k: "text", x: left - 8, y: top + l * (cell + pad) + cell / 2, s: "layer " + l, anchor: "end", size: 11 });
        for (let h = 0; h < H; h++) items.push({ k: "img", x: left + h * (cell + pad), y: top + l * (cell + pad), w: cell, h: cell, canvas: thumbs[l][h] });
      }
      return { w: left + H * (cell + pad) + 10, h: top + L * (cell + pad) + 10, items, label: "model view" };
    }
    function openHead(l, h) {
      hv.layer.value = String(l);
      headBoxes.forEach(b => { b.checked = +b.value === h; });
      show("head");
      hv.layer.focus();
    }

    /* ---- neuron view: q and k element by element, their products, the sum = the score ---- */
    const nv = qk ? {
      layer: $(".akp-neuron-layer"), head: $(".akp-neuron-head"), query: $(".akp-neuron-query"),
      key: $(".akp-neuron-key"), out: $(".akp-neuron-out"), sum: $(".akp-neuron-sum"),
    } : null;
    function neuron() {
      const l = +nv.layer.value, h = +nv.head.value, i = +nv.query.value, j = +nv.key.value, d = D.qk.d;
      const q = qk.q[l].subarray((h * T + i) * d, (h * T + i + 1) * d), k = qk.k[l].subarray((h * T + j) * d, (h * T + j + 1) * d);
      const products = Array.from(q, (x, n) => x * k[n]);
      const dot = products.reduce((a, b) => a + b, 0), scale = D.qk.scales[l];
      const qn = D.layers[l].qn, wq = i - (T - qn);
      return { l, h, i, j, q: Array.from(q), k: Array.from(k), products, dot, scale, score: dot * scale, weight: wq >= 0 ? w(l, h, wq, j) : NaN };
    }
    function neuronScene() {
      const n = neuron(), d = n.q.length, row = 16, top = 64, items = [];
      const col = [40, 50, 230, 410], bw = 100; // q, k, products: a bar, then its value
      const m = Math.max(1e-12, ...n.q.map(Math.abs), ...n.k.map(Math.abs));
      const mp = Math.max(1e-12, ...n.products.map(Math.abs));
      items.push({ k: "text", x: 10, y: 14, size: 13, bold: true, s: "neuron view \u00b7 layer " + n.l + " head " + n.h + ": query \u201c" + D.tokens[n.i] + "\u201d (" + n.i + ") \u00b7 key \u201c" + D.tokens[n.j] + "\u201d (" + n.j + ")" });
      items.push({ k: "text", x: 10, y: 32, size: 11, fill: "#555", s: D.rope ? "q and k after RoPE (as the attention receives them)" : "q and k as the attention receives them (no RoPE in this model)" });
      ["i", "q\u1d62", "k\u1d62", "q\u1d62 \u00b7 k\u1d62"].forEach((s, c) => items.push({ k: "text", x: c ? col[c] + bw / 2 : 10, y: top - 14, s, size: 12, bold: true, anchor: c ? "middle" : "start" }));
      for (let e = 0; e < d; e++) {
        const y = top + e * row;
        items.push({ k: "text", x: 10, y: y + row / 2, s: String(e), size: 11, fill: "#555" });
        [[n.q[e], m, "#1f77b4"], [n.k[e], m, "#d62728"], [n.products[e], mp, n.products[e] >= 0 ? "#2ca02c" : "#9467bd"]].forEach(([v, sc, colour], c) => {
          const x0 = col[c + 1], mid = x0 + bw / 2, len = (Math.abs(v) / sc) * (bw / 2);
          items.push({ k: "rect", x: v >= 0 ? mid : mid - len, y: y + 3, w: len, h: row - 6, fill: colour });
          items.push({ k: "rect", x: mid - 0.5, y: y + 1, w: 1, h: row - 2, fill: "#888" });
          items.push({ k: "text", x: x0 + bw + 4, y: y + row / 2, s: fmt(v, 4), size: 10, cls: c === 2 ? "akp-prod" : "" });
        });
      }
      const y = top + d * row + 14;
      items.push({ k: "text", x: 10, y, size: 12, bold: true, s: "\u03a3 q\u1d62\u00b7k\u1d62 = " + fmt(n.dot, 6) + "   \u00d7 scale " + n.scale.toPrecision(6) + " = score " + fmt(n.score, 6) + "   \u2192 weight " + (isNaN(n.weight) ? "\u2013" : n.weight.toFixed(4)) });
      return { w: 600, h: y + 20, items, n, label: "neuron view" };
    }
    function drawNeuron() {
      const scene = neuronScene(), n = scene.n;
      nv.out.innerHTML = ""; nv.out.appendChild(sceneToSvg(scene));
      nv.sum.textContent = "q \u00b7 k = " + fmt(n.dot, 6) + "; score = q \u00b7 k \u00d7 " + n.scale.toPrecision(6) + " = " + fmt(n.score, 6) + "; recorded weight " + (isNaN(n.weight) ? "\u2013" : n.weight.toFixed(6));
      nv.sum.dataset.dot = n.dot; nv.sum.dataset.score = n.score;
    }
    if (nv) {
      fillSelect(nv.layer, layerNames, 0);
      fillSelect(nv.head, [...Array(H).keys()].map(h => "head " + h), 0);
      fillSelect(nv.query, tokNames, T - 1);
      fillSelect(nv.key, tokNames, 0);
      [nv.layer, nv.head, nv.query, nv.key].forEach(s => s.addEventListener("change", drawNeuron));
    }

    /* ---- next-token panel: the recorded logits, sampled live ---- */
    const nt = D.next ? {
      temp: $(".akp-temp"), tempOut: $(".akp-temp-out"), topk: $(".akp-topk"), topp: $(".akp-topp"),
      toppOut: $(".akp-topp-out"), seed: $(".akp-seed"), stepBtn: $(".akp-step"), resetBtn: $(".akp-reset"),
      layer: $(".akp-next-layer"), seq: $(".akp-seq"), dist: $(".akp-dist"), status: $(".akp-status"), row: $(".akp-row"),
    } : null;
    let node = null, path = [], rand = null;
    function mulberry32(a) {
      return function () {
        a |= 0; a = a + 0x6D2B79F5 | 0;
        let t = Math.imul(a ^ a >>> 15, 1 | a);
        t = t + Math.imul(t ^ t >>> 7, 61 | t) ^ t;
        return ((t ^ t >>> 14) >>> 0) / 4294967296;
      };
    }
    /* temperature, then top-k, then top-p (as transformers' samplers), over the stored logits */
    function distribution() {
      const T_ = Math.max(1e-6, +nt.temp.value), k = Math.floor(+nt.topk.value) || 0, p = +nt.topp.value;
      const z = node.logits.map(x => x / T_), mx = Math.max(...z);
      let e = z.map(x => Math.exp(x - mx)), s = e.reduce((a, b) => a + b, 0);
      let probs = e.map(x => x / s); // sorted: the logits are stored largest first
      if (k > 0) probs = probs.map((x, i) => (i < k ? x : 0));
      s = probs.reduce((a, b) => a + b, 0); probs = probs.map(x => x / s);
      if (p < 1) {
        let c = 0, keep = 0;
        while (keep < probs.length && c < p) { c += probs[keep]; keep++; }
        probs = probs.map((x, i) => (i < Math.max(1, keep) ? x : 0));
        s = probs.reduce((a, b) => a + b, 0); probs = probs.map(x => x / s);
      }
      return node.ids.map((tid, i) => ({ id: tid, label: D.next.vocab[tid], p: probs[i] }));
    }
    function drawNext() {
      nt.tempOut.textContent = (+nt.temp.value).toFixed(2);
      nt.toppOut.textContent = (+nt.topp.value).toFixed(2);
      const seq = [...D.tokens.map(t => ({ t, gen: false })), ...path.map(n => ({ t: n.label, gen: true }))];
      nt.seq.innerHTML = "";
      seq.forEach(s => nt.seq.appendChild(el("span", { cls: s.gen ? "akp-tok akp-gen" : "akp-tok", text: s.t })));
      const dist = distribution(), recorded = new Set(node.children.map(c => c.t));
      const tbody = nt.dist.querySelector("tbody");
      tbody.innerHTML = "";
      dist.slice(0, 12).forEach(r => {
        const bar = el("span", { cls: "akp-bar" }); bar.style.width = (r.p * 100).toFixed(1) + "%";
        tbody.appendChild(el("tr", { cls: r.p === 0 ? "akp-out" : "" }, [
          el("td", { text: r.label }), el("td", { cls: "akp-p", text: r.p.toFixed(4) }),
          el("td", {}, [el("span", { cls: "akp-track" }, [bar])]),
          el("td", { text: recorded.has(r.id) ? "recorded" : "" }),
        ]));
      });
      nt.stepBtn.disabled = node.children.length === 0;
      if (!node.children.length) nt.status.textContent = "end of the recorded tree: reset to start again";
      drawRow();
    }
    function drawRow() {
      const l = +nt.layer.value, rows = node.rows[l], n = rows[0].length;
      const toks = [...D.tokens, ...path.map(p => p.label)].slice(0, n);
      const table = el("table", { cls: "akp-rowmap" });
      const hr = el("tr", {}, [el("th", { scope: "col", text: "head \\ key" })]);
      toks.forEach(t => hr.appendChild(el("th", { scope: "col", cls: "akp-k", text: t })));
      table.appendChild(hr);
      const vmax = Math.max(...rows.map(r => Math.max(...r))) || 1; // one scale for the table
      rows.forEach((r, h) => {
        const tr = el("tr", {}, [el("th", { scope: "row", text: "head " + h })]);
        r.forEach((v, j) => {
          const td = el("td", { title: toks[j] + ": " + v.toFixed(4) });
          td.style.background = css(viridis(v / vmax));
          td.textContent = v.toFixed(2);
          td.style.color = textOn(viridis(v / vmax));
          tr.appendChild(td);
        });
        table.appendChild(tr);
      });
      nt.row.innerHTML = ""; nt.row.appendChild(table);
    }
    function step() {
      if (!node.children.length) return null;
      const dist = distribution(), cands = node.children.map(c => ({ c, p: dist[node.ids.indexOf(c.t)].p })).filter(x => x.p > 0);
      const s = cands.reduce((a, x) => a + x.p, 0);
      let r = rand() * s, pick = cands[cands.length - 1];
      for (const x of cands) { r -= x.p; if (r < 0) { pick = x; break; } }
      node = pick.c; path.push(node);
      nt.status.textContent = "sampled \u201c" + node.label + "\u201d (p = " + pick.p.toFixed(4) + ", drawn among the " + cands.length + " recorded continuation(s), renormalised)";
      drawNext();
      return node.label;
    }
    function reset() {
      node = D.next.tree; path = []; rand = mulberry32(Math.floor(+nt.seed.value) || 0);
      nt.status.textContent = "";
      drawNext();
    }
    function decodeTree(n) {
      const rows = new Uint16Array(bytes(n.rows)), t = rows.length / (L * H), out = [];
      for (let l = 0; l < L; l++) {
        out.push([]);
        for (let h = 0; h < H; h++) out[l].push(Array.from(rows.subarray((l * H + h) * t, (l * H + h + 1) * t), x => x / 65535));
      }
      n.rows = out; n.children = n.c || []; n.t = n.t === undefined ? null : n.t;
      n.children.forEach(decodeTree);
    }
    if (nt) {
      decodeTree(D.next.tree);
      fillSelect(nt.layer, layerNames, L - 1);
      [nt.temp, nt.topk, nt.topp].forEach(c => c.addEventListener("input", drawNext));
      nt.layer.addEventListener("change", drawRow);
      nt.seed.addEventListener("change", reset);
      nt.stepBtn.addEventListener("click", step);
      nt.resetBtn.addEventListener("click", reset);
    }

    /* ---- switching views, export ---- */
    const drawn = {};
    const draws = { head: drawHead, model: drawModel, neuron: drawNeuron, next: reset };
    const scenes = { head: headScene, model: modelScene, neuron: neuronScene };
    function show(view) {
      root.querySelectorAll(".akp-tab").forEach(b => b.setAttribute("aria-pressed", String(b.dataset.view === view)));
      root.querySelectorAll(".akp-panel").forEach(p => { p.hidden = p.dataset.view !== view; });
      if (!drawn[view]) { draws[view](); drawn[view] = true; }
      root.dataset.view = view;
    }
    root.querySelectorAll(".akp-tab").forEach(b => b.addEventListener("click", () => show(b.dataset.view)));
    function svg(view) { return new XMLSerializer().serializeToString(sceneToSvg(scenes[view]())); }
    function png(view) { return sceneToCanvas(scenes[view]()).toDataURL("image/png"); }
    root.querySelectorAll(".akp-export").forEach(b => b.addEventListener("click", () => {
      const view = b.dataset.view, name = (D.file || "attention") + "-" + view + "." + b.dataset.format;
      download(name, b.dataset.format === "svg" ? "data:image/svg+xml;charset=utf-8," + encodeURIComponent(svg(view)) : png(view), root);
    }));
    const api = { show, svg, png, neuron: () => neuron(), distribution: () => distribution(), step, reset, openHead, data: D };
    window.attnkitViews[id] = api;
    show(D.start || "model");
    root.dataset.renderMs = performance.now().toFixed(1);
    return api;
  };
})();
