/* attnkit tutorial page: step navigation and "every cell explains itself".
   Reads the embedded JSON (#akdata): tokens, every matrix (m), each step's tables with the
   kind of their cells and the operand matrices. Numbers shown are the library's; this script
   only writes their computation out. No network, no globals beyond one IIFE. */
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("akdata").textContent);
  var M = D.m, TOK = D.tokens, U = D.t.ui;
  var TABLES = {};
  D.steps.forEach(function (s) { s.tables.forEach(function (tb) { TABLES[tb.id] = tb; }); });
  var sections = Array.prototype.slice.call(document.querySelectorAll("section.step"));
  var counter = document.getElementById("counter");
  var prev = document.getElementById("prev"), next = document.getElementById("next");
  var select = document.getElementById("query");
  var body = document.getElementById("why-body");
  var cur = 0, query = D.query;

  // ---- numbers, as the book prints them -------------------------------------------------
  function fmt(v, input) {
    if (v === null || v === undefined) { return "\u2212\u221e"; }
    var s;
    if (input) {
      s = v.toFixed(4).replace(/0+$/, "");
      var dec = s.split(".")[1] || "";
      while (dec.length < 2) { s += "0"; dec += "0"; }
    } else {
      s = v.toFixed(4);
    }
    if (parseFloat(s) === 0) { s = s.replace("-", ""); }
    return s.replace("-", "\u2212");
  }
  function op(v, input) { var s = fmt(v, input); return s.charAt(0) === "\u2212" ? "(" + s + ")" : s; }
  function isInput(name) { return name === "x"; }
  function vec(row, input) { return "[" + row.map(function (v) { return fmt(v, input); }).join(", ") + "]"; }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;" }[c];
    });
  }
  function fill(s, p) {
    return s.replace(/\{(\w+)\}/g, function (m, k) { return Object.prototype.hasOwnProperty.call(p, k) ? p[k] : m; });
  }
  function sym(name) { return name === "x" ? "x" : name; }
  function F(text) { return '<p class="f">' + esc(text) + "</p>"; }
  function P(text, cls) { return '<p' + (cls ? ' class="' + cls + '"' : "") + ">" + esc(text) + "</p>"; }
  function tok(i) { return TOK[i]; }
  function sum(a) { return a.reduce(function (s, v) { return s + v; }, 0); }
  function sub(n) { return String(n).replace(/\d/g, function (c) { return String.fromCharCode(0x2080 + +c); }); }
  function dims(n) { var out = []; for (var d = 0; d < n; d++) { out.push(d); } return out; }

  // ---- how each kind of cell was computed --------------------------------------------------
  function dotTerms(a, b, ai, bi) {
    return a[ai].map(function (v, d) { return op(v, ai === null) + "\u00b7" + op(b[bi][d]); });
  }
  function scoreFormula(tb, i, j) {
    // omega(i, j) as a dot product; scaled / masked tables also divide by sqrt(d_k).
    var a = M[tb.args.a], b = M[tb.args.b], inp = isInput(tb.args.a);
    var terms = a[i].map(function (v, d) { return op(v, inp) + "\u00b7" + op(b[j][d], inp); });
    var raw = sum(a[i].map(function (v, d) { return v * b[j][d]; }));
    var lhs = "\u03c9(" + tok(i) + ", " + tok(j) + ")";
    if (inp) { return [lhs + " = x(" + tok(i) + ")\u00b7x(" + tok(j) + ") = " + terms.join(" + ") + " = " + fmt(M[tb.matrix][i][j])]; }
    var dot = lhs + " = q(" + tok(i) + ")\u00b7k(" + tok(j) + ") = " + terms.join(" + ") + " = " + fmt(raw);
    if (tb.args.dk === undefined) { return [dot]; }
    var root = Math.sqrt(tb.args.dk);
    return [dot, lhs + " / \u221ad_k = " + fmt(raw) + " / \u221a" + tb.args.dk + " = " + fmt(raw) + " / " + fmt(root) + " = " + fmt(M[tb.matrix][i][j])];
  }
  function future(i, j) { return fill(U.masked_future, { key: tok(j), query: tok(i) }); }
  function rowTable(head, rows, hit) {
    var h = "<table class=\"rowt\"><thead><tr>" + head.map(function (c) { return '<th scope="col">' + esc(c) + "</th>"; }).join("") + "</tr></thead><tbody>";
    rows.forEach(function (r, k) {
      var cls = k === hit ? "hit" : (r.off ? "off" : "");
      h += "<tr" + (cls ? ' class="' + cls + '"' : "") + '><th scope="row">' + esc(r.cells[0]) + "</th>" + r.cells.slice(1).map(function (c) { return "<td>" + esc(c) + "</td>"; }).join("") + "</tr>";
    });
    return h + "</tbody></table>";
  }
  function sName(tb) { return tb.args.scaled ? "\u03c9/\u221ad_k" : "\u03c9"; }
  function valueLine(tb, i, j) {
    if (!tb.args.v) { return ""; }
    var v = M[tb.args.v];
    var name = tb.args.v === "x" ? "x" : "v";
    return P(fill(U.weights_value, { key: tok(j) })) + F(name + "(" + tok(j) + ") = " + vec(v[j], isInput(tb.args.v)));
  }

  var KINDS = {
    x: function (tb, i, j) {
      return P(fill(U.input, { d: j + 1, tok: tok(i) })) + F("x(" + tok(i) + ") = " + vec(M.x[i], true));
    },
    param: function (tb, i, j) {
      return F(tb.args.name + "[" + (i + 1) + ", " + (j + 1) + "] = " + fmt(M[tb.matrix][i][j])) + P(fill(U.param, { seed: tb.args.seed }));
    },
    proj: function (tb, i, j) {
      var x = M[tb.args.x], W = M[tb.args.W], n = tb.args.name;
      var terms = x[i].map(function (v, k) { return op(v, true) + "\u00b7" + op(W[k][j]); });
      return F(n + "(" + tok(i) + ")[" + (j + 1) + "] = x(" + tok(i) + ")\u00b7" + tb.args.wname + "[:, " + (j + 1) + "] = " + terms.join(" + ") + " = " + fmt(M[tb.matrix][i][j]))
        + F("x(" + tok(i) + ") = " + vec(x[i], true));
    },
    dot: function (tb, i, j) {
      return scoreFormula(tb, i, j).map(F).join("") + F("x(" + tok(i) + ") = " + vec(M.x[i], true)) + F("x(" + tok(j) + ") = " + vec(M.x[j], true));
    },
    scaled: function (tb, i, j) {
      return scoreFormula(tb, i, j).map(F).join("") + F("q(" + tok(i) + ") = " + vec(M[tb.args.a][i])) + F("k(" + tok(j) + ") = " + vec(M[tb.args.b][j]));
    },
    masked: function (tb, i, j) {
      if (j > i) { return F("\u03c9(" + tok(i) + ", " + tok(j) + ") = \u2212\u221e") + P(future(i, j), "note"); }
      return KINDS.scaled(tb, i, j);
    },
    naive: function (tb, i, j) {
      var s = M[tb.args.s][i], total = sum(s);
      var h = F("\u03b1(" + tok(i) + ", " + tok(j) + ") = \u03c9(" + tok(i) + ", " + tok(j) + ") / \u03a3 \u03c9(" + tok(i) + ", \u00b7) = " + fmt(s[j]) + " / " + fmt(total) + " = " + fmt(M[tb.matrix][i][j]));
      var rows = s.map(function (v, k) { return { cells: [tok(k), fmt(v), fmt(M[tb.matrix][i][k])] }; });
      rows.push({ cells: [U.sum, fmt(total), fmt(sum(M[tb.matrix][i]))] });
      return h + P(fill(U.naive_row, { query: tok(i) })) + rowTable([U.col_key, "\u03c9", U.col_weight], rows, j);
    },
    softmax: function (tb, i, j) {
      var s = M[tb.args.s][i], w = M[tb.matrix][i], name = sName(tb);
      var ex = s.map(function (v) { return v === null ? 0 : Math.exp(v); });
      var total = sum(ex), h;
      var lhs = "\u03b1(" + tok(i) + ", " + tok(j) + ")";
      if (s[j] === null) {
        h = F(lhs + " = exp(\u2212\u221e) / \u03a3 = " + fmt(w[j])) + P(fill(U.masked_weight, { key: tok(j), query: tok(i) }), "note");
      } else {
        h = F(lhs + " = exp(" + fmt(s[j]) + ") / \u03a3\u2096 exp(\u03c9(" + tok(i) + ", k)" + (tb.args.scaled ? "/\u221ad_k" : "") + ") = " + fmt(ex[j]) + " / " + fmt(total) + " = " + fmt(w[j]));
      }
      var rows = s.map(function (v, k) {
        return { off: v === null, cells: [tok(k), v === null ? "\u2212\u221e" : fmt(v), v === null ? "0" : fmt(ex[k]), fmt(w[k])] };
      });
      rows.push({ cells: [U.sum, "", fmt(total), fmt(sum(w))] });
      var masked = s.map(function (v, k) { return v === null ? tok(k) : null; }).filter(function (v) { return v !== null; });
      return h + P(fill(U.row, { query: tok(i) })) + rowTable([U.col_key, name, U.col_exp, U.col_weight], rows, j)
        + (masked.length ? P(fill(U.masked_list, { list: masked.join(", ") }), "note") : "") + valueLine(tb, i, j);
    },
    zero: function (tb, i, j) {
      var a = M[tb.args.w][i][j], keep = j > i ? 0 : 1;
      return F("\u03b1(" + tok(i) + ", " + tok(j) + ") \u00b7 mask(" + tok(i) + ", " + tok(j) + ") = " + fmt(a) + " \u00b7 " + keep + " = " + fmt(M[tb.matrix][i][j]))
        + (j > i ? P(fill(U.masked_zero, { key: tok(j), query: tok(i) }), "note") : "");
    },
    renorm: function (tb, i, j) {
      var z = M[tb.args.w][i], total = sum(z), w = M[tb.matrix][i];
      var h = F("\u03b1'(" + tok(i) + ", " + tok(j) + ") = " + fmt(z[j]) + " / (" + z.slice(0, i + 1).map(function (v) { return fmt(v); }).join(" + ") + ") = " + fmt(z[j]) + " / " + fmt(total) + " = " + fmt(w[j]));
      if (j > i) { h += P(fill(U.masked_weight, { key: tok(j), query: tok(i) }), "note"); }
      var rows = z.map(function (v, k) { return { off: k > i, cells: [tok(k), fmt(v), fmt(w[k])] }; });
      rows.push({ cells: [U.sum, fmt(total), fmt(sum(w))] });
      return h + rowTable([U.col_key, "\u03b1\u00b7mask", "\u03b1'"], rows, j);
    },
    drop: function (tb, i, j) {
      var before = M[tb.args.w][i][j], after = M[tb.matrix][i][j], p = tb.args.p;
      var keep = 1 / (1 - p), lhs = "dropout(\u03b1(" + tok(i) + ", " + tok(j) + "))";
      if (j > i) { return F(lhs + " = " + fmt(after)) + P(fill(U.masked_weight, { key: tok(j), query: tok(i) }), "note"); }
      if (after === 0) { return F(lhs + " = dropout(" + fmt(before) + ") = " + fmt(after)) + P(fill(U.dropped, { p: String(p) }), "note"); }
      return F(lhs + " = " + fmt(before) + " \u00b7 1/(1\u2212" + p + ") = " + fmt(before) + " \u00b7 " + fmt(keep) + " = " + fmt(after))
        + P(fill(U.kept, { keep: fmt(keep) }));
    },
    context: function (tb, i, j) {
      var w = M[tb.args.w][i], v = M[tb.args.v], inp = isInput(tb.args.v), vn = inp ? "x" : "v";
      var before = tb.args.before ? M[tb.args.before][i] : null;
      var terms = [], masked = [], dropped = [];
      w.forEach(function (a, k) {
        if (a !== 0) { terms.push(op(a) + "\u00b7" + op(v[k][j], inp)); }
        else if (tb.args.causal && k > i) { masked.push(tok(k)); }
        else if (before && before[k] !== 0) { dropped.push(tok(k)); }
        else { terms.push(op(a) + "\u00b7" + op(v[k][j], inp)); }
      });
      var h = F("z(" + tok(i) + ")[" + (j + 1) + "] = \u03a3\u2096 \u03b1(" + tok(i) + ", k)\u00b7" + vn + "(k)[" + (j + 1) + "] = " + (terms.length ? terms.join(" + ") : "0") + " = " + fmt(M[tb.matrix][i][j]));
      if (masked.length) { h += P(fill(U.left_out, { list: fill(U.masked_list, { list: masked.join(", ") }) }), "note"); }
      if (dropped.length) { h += P(fill(U.left_out, { list: fill(U.dropped_list, { list: dropped.join(", ") }) }), "note"); }
      var rows = w.map(function (a, k) { return { off: a === 0, cells: [tok(k), fmt(a), vec(v[k], inp)] }; });
      return h + rowTable([U.col_key, "\u03b1", vn], rows, -1);
    },
    concat: function (tb, i, j) {
      var hd = tb.args.head_dim, h = Math.floor(j / hd), d = j % hd;
      var z = M[tb.args.ctx + "." + h][i];
      return F("concat(" + tok(i) + ")[" + (j + 1) + "] = z" + sub(h + 1) + "(" + tok(i) + ")[" + (d + 1) + "] = " + fmt(M[tb.matrix][i][j]))
        + P(fill(U.concat, { d: d + 1, h: h + 1, tok: tok(i) })) + F("z" + sub(h + 1) + "(" + tok(i) + ") = " + vec(z));
    },
    out: function (tb, i, j) {
      var c = M[tb.args.c][i], W = M[tb.args.W], b = M[tb.args.b];
      var terms = c.map(function (v, k) { return op(v) + "\u00b7" + op(W[j][k]); });
      return F("y(" + tok(i) + ")[" + (j + 1) + "] = \u03a3\u2096 concat(" + tok(i) + ")[k]\u00b7W_out[" + (j + 1) + ", k] + b[" + (j + 1) + "] = " + terms.join(" + ") + " + " + op(b[j]) + " = " + fmt(M[tb.matrix][i][j]))
        + F("concat(" + tok(i) + ") = " + vec(c)) + F(U.bias + " = " + vec(b));
    }
  };

  // ---- the cells a number came from, outlined where the step shows them ----------------------
  function sources(tb, i, j) {
    var a = tb.args;
    switch (tb.kind) {
      case "dot": case "scaled": case "masked": return [[a.a, i], [a.b, j]];
      case "proj": return [[a.x, i]];
      case "naive": case "softmax": return [[a.s, i]];
      case "zero": case "renorm": case "drop": return [[a.w, i]];
      case "context": return [[a.w, i]].concat(TOK.map(function (t, k) { return [a.v, k]; }));
      case "concat": return [[a.ctx + "." + Math.floor(j / a.head_dim), i]];
      case "out": return [[a.c, i]];
      default: return [];
    }
  }
  function outline(tb, i, j) {
    Array.prototype.forEach.call(document.querySelectorAll("td.src"), function (td) { td.classList.remove("src"); });
    var step = sections[cur];
    sources(tb, i, j).forEach(function (src) {
      Array.prototype.forEach.call(step.querySelectorAll('table[data-matrix="' + src[0] + '"] tr[data-i="' + src[1] + '"] td'), function (td) {
        td.classList.add("src");
      });
    });
  }

  // ---- the explanation panel ---------------------------------------------------------------
  var selected = null;
  function explainCell(btn) {
    // the cell's table, row and column come from where it sits (no per-cell attributes)
    var td = btn.parentNode, tr = td.parentNode;
    var tb = TABLES[tr.parentNode.parentNode.getAttribute("data-table")];
    var i = +tr.getAttribute("data-i"), j = td.cellIndex - 1;
    if (selected) { selected.classList.remove("sel"); }
    selected = btn.parentNode;
    selected.classList.add("sel");
    body.innerHTML = '<p class="why-cap">' + esc(tb.caption) + "</p>" + KINDS[tb.kind](tb, i, j);
    body.setAttribute("data-cell", tb.id + ":" + i + ":" + j);
    outline(tb, i, j);
  }
  document.addEventListener("click", function (e) {
    var btn = e.target.closest ? e.target.closest("button.cell") : null;
    if (btn) { explainCell(btn); }
  });
  document.addEventListener("focusin", function (e) {
    if (e.target.classList && e.target.classList.contains("cell")) { explainCell(e.target); }
  });

  // ---- steps and query rows ----------------------------------------------------------------
  function show(n) {
    cur = Math.max(0, Math.min(sections.length - 1, n));
    sections.forEach(function (s, k) { s.hidden = k !== cur; });
    counter.textContent = fill(counter.getAttribute("data-template"), { n: cur + 1, total: sections.length });
    prev.disabled = cur === 0;
    next.disabled = cur === sections.length - 1;
    document.body.setAttribute("data-step", sections[cur].getAttribute("data-step"));
  }
  function setQuery(q) {
    query = Math.max(0, Math.min(TOK.length - 1, q));
    select.value = String(query);
    Array.prototype.forEach.call(document.querySelectorAll("table:not([data-kind=param]) > tbody > tr[data-i]"), function (tr) {
      var hit = +tr.getAttribute("data-i") === query;
      tr.classList.toggle("q", hit);
      if (tr.parentNode.parentNode.classList.contains("query-only")) { tr.hidden = !hit; }
    });
    Array.prototype.forEach.call(document.querySelectorAll(".qname"), function (s) { s.textContent = TOK[query]; });
    document.body.setAttribute("data-query", String(query));
  }
  prev.addEventListener("click", function () { show(cur - 1); });
  next.addEventListener("click", function () { show(cur + 1); });
  select.addEventListener("change", function () { setQuery(+select.value); });
  document.addEventListener("keydown", function (e) {
    var tag = e.target && e.target.tagName;
    if (tag === "SELECT" || tag === "INPUT" || tag === "TEXTAREA" || e.altKey || e.ctrlKey || e.metaKey) { return; }
    var moves = { ArrowLeft: [-1, 0], ArrowRight: [1, 0], ArrowUp: [0, -1], ArrowDown: [0, 1] };
    var m = moves[e.key];
    if (!m) { return; }
    e.preventDefault();
    if (m[0]) { show(cur + m[0]); } else { setQuery(query + m[1]); }
  });
  show(0);
  setQuery(query);
})();
