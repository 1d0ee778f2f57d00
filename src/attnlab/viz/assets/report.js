/* attnlab interactive attention report.
 *
 * Starts every `.attnlab-report` element on the page that has not started yet (a Jupyter
 * notebook may hold several). Each one carries its data in a
 * JSON script element (class al-data) inside it. User text (tokens, text, model
 * name, notes) is only ever written with textContent; no markup is built from it and no
 * inline event handler exists. Nothing is fetched: the numbers are inflated from the
 * embedded base64 block with the browser's DecompressionStream.
 */
(function () {
  "use strict";

  var NS = "http://www.w3.org/2000/svg";
  var PALETTE = ["#1f77b4", "#e6550d", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#6b6b6b", "#a6a600", "#17becf", "#3b3eac", "#b8860b"];
  var FONT = 'system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif';
  var VIEWS = [
    ["head", "Head view"], ["model", "Model view"], ["heatmap", "Heatmap"],
    ["steps", "Steps"], ["embedding", "Embeddings"]
  ];

  function headColor(h) {
    return h < PALETTE.length ? PALETTE[h] : "hsl(" + ((h * 137.5) % 360).toFixed(0) + ",60%,42%)";
  }

  function lut(stops) {
    var out = new Uint8ClampedArray(256 * 3);
    for (var k = 0; k < 256; k++) {
      var t = k / 255 * (stops.length - 1);
      var a = Math.min(stops.length - 2, Math.floor(t));
      var f = t - a;
      for (var c = 0; c < 3; c++) out[k * 3 + c] = stops[a][c] + (stops[a + 1][c] - stops[a][c]) * f;
    }
    return out;
  }
  var SEQ = lut([[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]]);
  var DIV = lut([[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]]);

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function sv(tag, attrs, text) {
    var e = document.createElementNS(NS, tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function show(tok) {
    if (tok === "") return "\u2205";
    var s = tok.replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5");
    if (/^\s+$/.test(s)) s = s.replace(/ /g, "\u2423");
    return s;
  }
  function short(tok, n) {
    var s = show(tok);
    return s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
  }
  function fmt(v) {
    if (v === -Infinity) return "-\u221e";
    if (v === Infinity) return "\u221e";
    if (v !== v) return "NaN";
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e4)) return v.toExponential(2);
    return v.toFixed(a >= 100 ? 1 : 3);
  }
  function clamp(x, lo, hi) { return Math.max(lo, Math.min(hi, x)); }

  /* An image (data: URL) of a rows x cols matrix; levelOf(i, j) gives a level 0..255 of the
     colour table `table`, or -1 for a cell with no value (drawn grey). */
  function matrixImage(rows, cols, table, levelOf) {
    var cv = document.createElement("canvas");
    cv.width = cols; cv.height = rows;
    var ctx = cv.getContext("2d");
    var img = ctx.createImageData(cols, rows);
    var px = img.data, p = 0;
    for (var i = 0; i < rows; i++) {
      for (var j = 0; j < cols; j++, p += 4) {
        var k = levelOf(i, j);
        if (k < 0) { px[p] = 190; px[p + 1] = 190; px[p + 2] = 190; }
        else { k *= 3; px[p] = table[k]; px[p + 1] = table[k + 1]; px[p + 2] = table[k + 2]; }
        px[p + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
    return cv.toDataURL("image/png");
  }

  function b64bytes(s) {
    var bin = atob(s), n = bin.length, out = new Uint8Array(n);
    for (var i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  function inflate(b64) {
    if (typeof DecompressionStream === "undefined") {
      return Promise.reject(new Error("this browser has no DecompressionStream (use a current Chrome, Edge, Firefox or Safari)"));
    }
    var stream = new Blob([b64bytes(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }
  function unpack(refs, buf) {
    var out = {};
    Object.keys(refs).forEach(function (k) {
      var r = refs[k], n = r.shape.reduce(function (a, b) { return a * b; }, 1);
      out[k] = r.dtype === "u8" ? new Uint8Array(buf, r.offset, n) : new Float32Array(buf, r.offset, n);
    });
    return out;
  }

  function fail(app, msg) {
    app.replaceChildren(el("p", { "class": "al-error" }, "attnlab report: " + msg));
  }

  function start(root) {
    var t0 = performance.now();
    var app = root.querySelector(".al-app");
    var dataEl = root.querySelector("script.al-data");
    var data;
    try { data = JSON.parse(dataEl.textContent); } catch (e) { fail(app, "cannot read the data: " + e.message); return; }
    inflate(data.blob).then(function (buf) {
      var arrays = unpack(data.arrays, buf);
      new Report(root, app, data, arrays);
      root.setAttribute("data-render-ms", (performance.now() - t0).toFixed(1));
      root.setAttribute("data-ready-at-ms", performance.now().toFixed(1));
      root.setAttribute("data-ready", "1");
    }).catch(function (e) {
      fail(app, "cannot decode the data: " + (e && e.message ? e.message : e));
      root.setAttribute("data-ready", "error");
    });
  }

  /* ------------------------------------------------------------------ the report */

  function Report(root, app, data, arrays) {
    var self = this;
    this.root = root; this.app = app; this.data = data;
    this.T = data.T; this.L = data.layers; this.H = data.heads; this.tokens = data.tokens;
    this.codes = arrays.attn; this.rowmax = arrays.rowmax; this.arrays = arrays;
    this.thumbs = {};
    var stepHeads = {};
    data.steps.forEach(function (s) { if (s.head !== null) stepHeads[s.head] = true; });
    this.stepHeads = Object.keys(stepHeads).map(Number).sort(function (a, b) { return a - b; });
    this.state = {
      view: "head", layer: data.layer || 0, head: data.head || 0, heads: [], gain: 1,
      stepHead: this.stepHeads.indexOf(data.head || 0) >= 0 ? (data.head || 0) : (this.stepHeads.length ? this.stepHeads[0] : 0)
    };
    for (var h = 0; h < this.H; h++) this.state.heads.push(true);

    app.replaceChildren();
    if (data.notes.length) {
      var ul = el("ul", { "class": "al-notes" });
      data.notes.forEach(function (n) { ul.appendChild(el("li", null, n)); });
      app.appendChild(ul);
    }
    var tabs = el("div", { "class": "al-tabs", role: "tablist" });
    this.tabButtons = {};
    VIEWS.forEach(function (v) {
      var b = el("button", { "class": "al-tab", role: "tab", type: "button", "data-view": v[0] }, v[1]);
      if (v[0] === "steps" && !data.steps.length) {
        b.disabled = true;
        b.title = "no step-by-step trace: only the tutorial model (attnlab explain --model random) records one";
      }
      b.addEventListener("click", function () { self.set({ view: v[0] }); });
      self.tabButtons[v[0]] = b;
      tabs.appendChild(b);
    });
    app.appendChild(tabs);
    this.controls = el("div", { "class": "al-controls" });
    this.hint = el("p", { "class": "al-hint" });
    this.stage = el("div", { "class": "al-stage" });
    this.tip = el("div", { "class": "al-tip", role: "status" });
    this.foot = el("p", { "class": "al-foot" },
      "Attention weights are stored with 8 bits per value relative to each row's maximum " +
      "(error at most 0.2% of that maximum). The file makes no network request.");
    app.appendChild(this.controls);
    app.appendChild(this.hint);
    app.appendChild(this.stage);
    app.appendChild(this.foot);
    root.appendChild(this.tip);
    this.render();
  }

  Report.prototype.value = function (l, h, i, j) {
    var r = (l * this.H + h) * this.T + i;
    return this.codes[r * this.T + j] * this.rowmax[r] / 255;
  };

  Report.prototype.set = function (patch) {
    for (var k in patch) this.state[k] = patch[k];
    this.render();
  };

  Report.prototype.render = function () {
    var t = performance.now(), s = this.state;
    this.hideTip();
    for (var v in this.tabButtons) this.tabButtons[v].setAttribute("aria-selected", String(v === s.view));
    this.buildControls();
    var svg;
    if (s.view === "head") svg = this.headView();
    else if (s.view === "model") svg = this.modelView();
    else if (s.view === "heatmap") svg = this.heatmapView();
    else if (s.view === "steps") svg = this.stepsView();
    else svg = this.embeddingView();
    svg.setAttribute("xmlns", NS);
    svg.classList.add("al-view");
    this.stage.replaceChildren(svg);
    this.root.setAttribute("data-view", s.view);
    this.root.setAttribute("data-last-render-ms", (performance.now() - t).toFixed(1));
  };

  /* ------------------------------------------------------------------ controls */

  Report.prototype.buildControls = function () {
    var self = this, s = this.state, c = this.controls;
    c.replaceChildren();
    var hints = {
      head: "Lines join each token on the left (the query) to the tokens it attends to on the right; " +
        "stronger weights draw darker. Hover a token to see only its lines. Click a colour to show or hide a head, double-click it to see that head alone.",
      model: "Every layer and head at a glance (each thumbnail scaled to its own maximum). Click one to open it in the head view.",
      heatmap: "Rows: queries, columns: keys. Point at a cell for its weight. Click a colour to pick the head.",
      steps: "One attention call step by step, as the tutorial model computed it. Point at a cell for its value. Click a colour to pick the head.",
      embedding: "Token vectors before attention (hollow) and after (filled), projected on their first two principal components. Point at a token for its name."
    };
    this.hint.textContent = hints[s.view];

    if (s.view === "head" || s.view === "heatmap") {
      var lab = el("label", null, "Layer ");
      var sel = el("select", { "class": "al-layer", "aria-label": "layer" });
      for (var l = 0; l < this.L; l++) {
        var o = el("option", { value: String(l) }, String(l + 1));  // layers are numbered 1..n
        if (l === s.layer) o.selected = true;
        sel.appendChild(o);
      }
      sel.addEventListener("change", function () { self.set({ layer: Number(sel.value) }); });
      lab.appendChild(sel);
      c.appendChild(lab);
    }
    var heads = null, pressed, onChip;
    if (s.view === "head") {
      heads = range(this.H);
      pressed = function (h) { return s.heads[h]; };
      onChip = function (h) { var hs = s.heads.slice(); hs[h] = !hs[h]; self.set({ heads: hs, head: h }); };
    } else if (s.view === "heatmap") {
      heads = range(this.H);
      pressed = function (h) { return h === s.head; };
      onChip = function (h) { self.set({ head: h }); };
    } else if (s.view === "steps" && this.stepHeads.length > 1) {
      heads = this.stepHeads;
      pressed = function (h) { return h === s.stepHead; };
      onChip = function (h) { self.set({ stepHead: h }); };
    }
    if (heads) {
      var wrap = el("label", null, "Heads ");
      var chips = el("span", { "class": "al-chips" });
      heads.forEach(function (h) {
        var b = el("button", { type: "button", "class": "al-chip", "data-head": String(h),
          "aria-pressed": String(pressed(h)), title: "head " + h }, String(h));
        b.style.setProperty("--c", headColor(h));
        b.addEventListener("click", function () { onChip(h); });
        if (s.view === "head") {
          b.addEventListener("dblclick", function () {
            self.set({ head: h, heads: heads.map(function (k) { return k === h; }) });
          });
        }
        chips.appendChild(b);
      });
      wrap.appendChild(chips);
      c.appendChild(wrap);
      if (s.view === "head") {
        var all = el("button", { type: "button", "class": "al-btn al-all" }, "all");
        all.addEventListener("click", function () { self.set({ heads: heads.map(function () { return true; }) }); });
        var none = el("button", { type: "button", "class": "al-btn al-none" }, "none");
        none.addEventListener("click", function () { self.set({ heads: heads.map(function () { return false; }) }); });
        c.appendChild(all); c.appendChild(none);
      }
    }
    if (s.view === "head") {
      var gl = el("label", null, "Contrast ");
      var gs = el("select", { "class": "al-gain", "aria-label": "line contrast" });
      [1, 2, 5, 10, 25].forEach(function (g) {
        var o = el("option", { value: String(g) }, "\u00d7" + g);
        if (g === s.gain) o.selected = true;
        gs.appendChild(o);
      });
      gs.addEventListener("change", function () { self.set({ gain: Number(gs.value) }); });
      gl.appendChild(gs);
      c.appendChild(gl);
    }
    c.appendChild(el("span", { "class": "al-spacer" }));
    var svgBtn = el("button", { type: "button", "class": "al-btn al-export-svg" }, "Export SVG");
    var pngBtn = el("button", { type: "button", "class": "al-btn al-export-png" }, "Export PNG");
    svgBtn.addEventListener("click", function () { self.exportSVG(); });
    pngBtn.addEventListener("click", function () { self.exportPNG(); });
    c.appendChild(svgBtn); c.appendChild(pngBtn);
  };

  function range(n) { var a = []; for (var i = 0; i < n; i++) a.push(i); return a; }

  /* ------------------------------------------------------------------ tooltip */

  Report.prototype.showTip = function (ev, text) {
    var r = this.root.getBoundingClientRect();
    this.tip.textContent = text;
    this.tip.style.display = "block";
    var x = ev.clientX - r.left + 14, y = ev.clientY - r.top + 14;
    var w = this.tip.offsetWidth;
    if (x + w > r.width) x = Math.max(0, ev.clientX - r.left - w - 10);
    this.tip.style.left = x + "px";
    this.tip.style.top = y + "px";
  };
  Report.prototype.hideTip = function () { this.tip.style.display = "none"; };

  /* Pointer over a matrix drawn at (x, y) with size w x h: tooltip with its cell's text. */
  Report.prototype.hover = function (target, rows, cols, textOf, marker) {
    var self = this;
    target.addEventListener("mousemove", function (ev) {
      var r = target.getBoundingClientRect();
      var j = clamp(Math.floor((ev.clientX - r.left) / r.width * cols), 0, cols - 1);
      var i = clamp(Math.floor((ev.clientY - r.top) / r.height * rows), 0, rows - 1);
      self.showTip(ev, textOf(i, j));
      if (marker) marker(i, j);
    });
    target.addEventListener("mouseleave", function () { self.hideTip(); if (marker) marker(-1, -1); });
  };

  /* ------------------------------------------------------------------ head view */

  Report.prototype.headView = function () {
    var self = this, T = this.T, s = this.state, tokens = this.tokens;
    var rowH = T <= 40 ? 22 : T <= 120 ? 17 : 14;
    var fs = clamp(rowH - 7, 9, 14);
    var longest = 0;
    tokens.forEach(function (t) { longest = Math.max(longest, Math.min(18, show(t).length)); });
    var labelW = clamp(longest * fs * 0.62 + 14, 44, 180);
    var gap = 360, pad = 12, top = 44;
    var W = pad * 2 + labelW * 2 + gap, Hh = top + T * rowH + pad;
    var x1 = pad + labelW, x2 = pad + labelW + gap;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    var visible = [];
    s.heads.forEach(function (on, h) { if (on) visible.push(h); });
    svg.appendChild(sv("text", { x: pad, y: 15, "font-size": 12, fill: "#1d2330", "font-weight": 600 },
      "layer " + (s.layer + 1) + ", heads " + (visible.length ? compact(visible) : "none")));
    svg.appendChild(sv("text", { x: x1 - 4, y: 33, "text-anchor": "end", "font-size": 11, fill: "#5b6475" }, "query"));
    svg.appendChild(sv("text", { x: x2 + 4, y: 33, "text-anchor": "start", "font-size": 11, fill: "#5b6475" }, "key"));
    var lines = sv("g", { "class": "al-lines", fill: "none", "stroke-linecap": "round" });
    svg.appendChild(lines);
    var ys = function (i) { return top + i * rowH + rowH / 2; };

    var draw = function (only) {
      lines.replaceChildren();
      visible.forEach(function (h) { self.headPaths(lines, s.layer, h, only, x1 + 3, x2 - 3, ys); });
    };
    draw(null);

    var labels = sv("g", { "font-size": fs });
    var marks = [[], []];
    [0, 1].forEach(function (side) {
      for (var i = 0; i < T; i++) {
        var y = top + i * rowH;
        var g = sv("g", { "class": "al-tok", "data-side": String(side), "data-idx": String(i) });
        var bg = sv("rect", { x: side ? x2 : pad, y: y + 1, width: labelW, height: rowH - 2, rx: 3,
          fill: "#2f5dd0", "fill-opacity": 0 });
        var tx = sv("text", { x: side ? x2 + 4 : x1 - 4, y: y + rowH / 2, "dominant-baseline": "central",
          "text-anchor": side ? "start" : "end", fill: "#1d2330" }, short(tokens[i], 18));
        g.appendChild(bg); g.appendChild(tx);
        g.appendChild(sv("title", null, "token " + i + ": " + tokens[i]));
        marks[side].push(bg);
        labels.appendChild(g);
      }
    });
    svg.appendChild(labels);

    var current = null;
    labels.addEventListener("mouseover", function (ev) {
      var g = ev.target.closest ? ev.target.closest(".al-tok") : null;
      if (!g) return;
      var side = Number(g.getAttribute("data-side")), i = Number(g.getAttribute("data-idx"));
      if (current && current[0] === side && current[1] === i) return;
      current = [side, i];
      draw({ side: side, idx: i });
      // shade the other side by the weight of the first visible head
      var h0 = visible.length ? visible[0] : -1;
      for (var k = 0; k < T; k++) {
        var w = h0 < 0 ? 0 : side === 0 ? self.value(s.layer, h0, i, k) : self.value(s.layer, h0, k, i);
        marks[1 - side][k].setAttribute("fill-opacity", (0.6 * w).toFixed(3));
        marks[side][k].setAttribute("fill-opacity", k === i ? "0.18" : "0");
      }
    });
    labels.addEventListener("mouseleave", function () {
      current = null;
      draw(null);
      marks.forEach(function (m) { m.forEach(function (r) { r.setAttribute("fill-opacity", 0); }); });
    });
    return svg;
  };

  function compact(list) {
    if (list.length > 1 && list[list.length - 1] - list[0] === list.length - 1) return list[0] + "\u2013" + list[list.length - 1];
    return list.join(", ");
  }

  /* The lines of one head as a few <path>s, one per opacity level (fast for 256 x 256). */
  var LEVELS = 16, CAP = 12000;
  Report.prototype.headPaths = function (parent, l, h, only, xa, xb, ys) {
    var T = this.T, gain = this.state.gain, min = only ? 0.004 : 0.02;
    var base = (l * this.H + h) * T, codes = this.codes, rowmax = this.rowmax;
    var counts = new Array(LEVELS).fill(0);
    var i0 = 0, i1 = T, j0 = 0, j1 = T;
    if (only && only.side === 0) { i0 = only.idx; i1 = i0 + 1; }
    if (only && only.side === 1) { j0 = only.idx; j1 = j0 + 1; }
    var i, j, w, lv;
    for (i = i0; i < i1; i++) {
      var sc = rowmax[base + i] * gain / 255, off = (base + i) * T;
      for (j = j0; j < j1; j++) {
        w = codes[off + j] * sc;
        if (w < min) continue;
        lv = w >= 1 ? LEVELS - 1 : Math.floor(w * LEVELS);
        counts[lv]++;
      }
    }
    // keep the strongest levels when a head has too many lines to draw quickly
    var cut = 0, total = 0;
    for (lv = LEVELS - 1; lv >= 0; lv--) { total += counts[lv]; if (total > CAP) { cut = lv + 1; break; } }
    var parts = [];
    for (lv = 0; lv < LEVELS; lv++) parts.push([]);
    for (i = i0; i < i1; i++) {
      var sc2 = rowmax[base + i] * gain / 255, off2 = (base + i) * T, y1 = ys(i).toFixed(1);
      for (j = j0; j < j1; j++) {
        w = codes[off2 + j] * sc2;
        if (w < min) continue;
        lv = w >= 1 ? LEVELS - 1 : Math.floor(w * LEVELS);
        if (lv < cut) continue;
        parts[lv].push("M" + xa + " " + y1 + "L" + xb + " " + ys(j).toFixed(1));
      }
    }
    var color = headColor(h);
    for (lv = 0; lv < LEVELS; lv++) {
      if (!parts[lv].length) continue;
      var a = (lv + 1) / LEVELS;
      parent.appendChild(sv("path", { d: parts[lv].join(""), stroke: color,
        "stroke-opacity": (0.12 + 0.88 * a).toFixed(3), "stroke-width": (0.6 + 2.4 * a).toFixed(2),
        "data-head": String(h) }));
    }
  };

  /* ------------------------------------------------------------------ model view */

  Report.prototype.thumb = function (l, h, n) {
    var key = l + "," + h + "," + n;
    if (this.thumbs[key]) return this.thumbs[key];
    var T = this.T, self = this;
    // max-pool the T x T map to n x n, then scale to its own maximum
    var pooled = new Float32Array(n * n), mx = 0;
    for (var a = 0; a < n; a++) {
      var ia = Math.floor(a * T / n), ib = Math.max(ia + 1, Math.floor((a + 1) * T / n));
      for (var i = ia; i < ib; i++) {
        for (var b = 0; b < n; b++) {
          var ja = Math.floor(b * T / n), jb = Math.max(ja + 1, Math.floor((b + 1) * T / n));
          var m = pooled[a * n + b];
          for (var j = ja; j < jb; j++) { var v = self.value(l, h, i, j); if (v > m) m = v; }
          pooled[a * n + b] = m;
          if (m > mx) mx = m;
        }
      }
    }
    var inv = mx > 0 ? 255 / mx : 0;
    var url = matrixImage(n, n, SEQ, function (i, j) { return Math.round(pooled[i * n + j] * inv); });
    this.thumbs[key] = url;
    return url;
  };

  Report.prototype.modelView = function () {
    var self = this, s = this.state, L = this.L, H = this.H, T = this.T;
    var cell = clamp(Math.floor(1040 / H) - 8, 34, 88);
    var n = Math.min(T, cell);
    var left = 64, top = 44, gapc = 8;
    var W = Math.max(240, left + H * (cell + gapc) + 12), Hh = top + L * (cell + gapc) + 12;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: left, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      L + " layer(s) \u00d7 " + H + " head(s)"));
    for (var h = 0; h < H; h++) {
      svg.appendChild(sv("text", { x: left + h * (cell + gapc) + cell / 2, y: top - 8, "text-anchor": "middle",
        "font-size": 11, fill: headColor(h), "font-weight": 600 }, "head " + h));
    }
    for (var l = 0; l < L; l++) {
      var y = top + l * (cell + gapc);
      svg.appendChild(sv("text", { x: left - 8, y: y + cell / 2, "text-anchor": "end", "dominant-baseline": "central",
        "font-size": 11, fill: "#5b6475" }, "layer " + (l + 1)));
      for (h = 0; h < H; h++) {
        var x = left + h * (cell + gapc);
        var g = sv("g", { "class": "al-thumb", "data-layer": String(l), "data-head": String(h) });
        g.appendChild(sv("image", { x: x, y: y, width: cell, height: cell, href: this.thumb(l, h, n),
          preserveAspectRatio: "none", "image-rendering": "pixelated", style: "image-rendering:pixelated" }));
        var current = l === s.layer && h === s.head;
        g.appendChild(sv("rect", { x: x - 0.5, y: y - 0.5, width: cell + 1, height: cell + 1, fill: "none",
          stroke: current ? "#2f5dd0" : "#c4c9d3", "stroke-width": current ? 2.5 : 1 }));
        g.appendChild(sv("title", null, "layer " + (l + 1) + ", head " + h + ": click to open in the head view"));
        svg.appendChild(g);
      }
    }
    svg.addEventListener("click", function (ev) {
      var g = ev.target.closest ? ev.target.closest(".al-thumb") : null;
      if (!g) return;
      var l2 = Number(g.getAttribute("data-layer")), h2 = Number(g.getAttribute("data-head"));
      var hs = s.heads.map(function (_, k) { return k === h2; });
      self.set({ view: "head", layer: l2, head: h2, heads: hs });
    });
    return svg;
  };

  /* ------------------------------------------------------------------ heatmap view */

  Report.prototype.heatmapView = function () {
    var self = this, s = this.state, T = this.T, tokens = this.tokens, l = s.layer, h = s.head;
    var cell = clamp(640 / T, 1, 30);
    var size = cell * T;
    var labels = cell >= 9;
    var step = labels ? 1 : Math.ceil(10 / cell);
    var fs = clamp(Math.floor(cell) - 2, 9, 12);
    var longest = 0;
    tokens.forEach(function (t) { longest = Math.max(longest, Math.min(14, show(t).length)); });
    var lab = clamp(longest * fs * 0.62 + (labels ? 10 : 34), 40, 140);
    var left = lab + 8, top = lab + 30, barW = 14;
    var W = Math.max(380, left + size + 80), Hh = top + size + 16;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      "layer " + (l + 1) + ", head " + h + " (rows: queries, columns: keys)"));
    var mx = 0;
    for (var i = 0; i < T; i++) for (var j = 0; j < T; j++) mx = Math.max(mx, this.value(l, h, i, j));
    var inv = mx > 0 ? 255 / mx : 0;
    svg.appendChild(sv("image", { x: left, y: top, width: size, height: size, preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated",
      href: matrixImage(T, T, SEQ, function (i, j) { return Math.round(self.value(l, h, i, j) * inv); }) }));
    if (T <= 16) {
      var vals = sv("g", { "font-size": clamp(cell * 0.34, 8, 11), "text-anchor": "middle", "pointer-events": "none" });
      for (i = 0; i < T; i++) for (j = 0; j < T; j++) {
        var v = this.value(l, h, i, j);
        vals.appendChild(sv("text", { x: left + (j + 0.5) * cell, y: top + (i + 0.5) * cell, "dominant-baseline": "central",
          fill: v * inv > 150 ? "#fff" : "#1d2330" }, v.toFixed(2)));
      }
      svg.appendChild(vals);
    }
    var ticks = sv("g", { "font-size": fs, fill: "#1d2330" });
    for (i = 0; i < T; i += step) {
      var name = labels ? short(tokens[i], 14) : i + " " + short(tokens[i], 8);
      ticks.appendChild(sv("text", { x: left - 4, y: top + (i + 0.5) * cell, "text-anchor": "end", "dominant-baseline": "central" }, name));
      var cx = left + (i + 0.5) * cell, cy = top - 4;
      ticks.appendChild(sv("text", { x: cx, y: cy, transform: "rotate(-60 " + cx + " " + cy + ")", "dominant-baseline": "central" }, name));
    }
    svg.appendChild(ticks);
    // colour bar
    var bx = left + size + 18, bh = Math.max(60, Math.min(size, 240));
    svg.appendChild(sv("image", { x: bx, y: top, width: barW, height: bh, preserveAspectRatio: "none",
      href: matrixImage(64, 1, SEQ, function (i) { return Math.round((63 - i) / 63 * 255); }) }));
    svg.appendChild(sv("rect", { x: bx, y: top, width: barW, height: bh, fill: "none", stroke: "#c4c9d3" }));
    svg.appendChild(sv("text", { x: bx + barW + 4, y: top + 4, "font-size": 11, "dominant-baseline": "hanging", fill: "#5b6475" }, fmt(mx)));
    svg.appendChild(sv("text", { x: bx + barW + 4, y: top + bh, "font-size": 11, fill: "#5b6475" }, "0"));
    var mark = sv("rect", { width: cell, height: cell, fill: "none", stroke: "#e6550d", "stroke-width": 1.5,
      visibility: "hidden", "pointer-events": "none" });
    var hit = sv("rect", { "class": "al-hit", x: left, y: top, width: size, height: size, fill: "transparent" });
    svg.appendChild(hit);
    svg.appendChild(mark);
    this.hover(hit, T, T, function (i, j) {
      return "query " + i + " \u201c" + short(tokens[i], 30) + "\u201d \u2192 key " + j + " \u201c" +
        short(tokens[j], 30) + "\u201d\nweight " + self.value(l, h, i, j).toFixed(4);
    }, function (i, j) {
      if (i < 0) { mark.setAttribute("visibility", "hidden"); return; }
      mark.setAttribute("x", left + j * cell); mark.setAttribute("y", top + i * cell);
      mark.setAttribute("visibility", "visible");
    });
    return svg;
  };

  /* ------------------------------------------------------------------ step view */

  Report.prototype.stepsView = function () {
    var self = this, s = this.state, tokens = this.tokens;
    var chosen = [], seen = {};
    this.data.steps.forEach(function (st) {
      if (st.head !== null && st.head !== s.stepHead) return;
      if (seen[st.name + "|" + st.head]) return;
      seen[st.name + "|" + st.head] = true;
      chosen.push(st);
    });
    var maxW = 1120, x = 0, y = 40, rowH = 0, cards = [];
    chosen.forEach(function (st) {
      var ref = self.data.arrays[st.array], rows = ref.shape[0], cols = ref.shape[1];
      // square cells that fit 320 x 320, stretched to at least 48 px each way
      var fitW = clamp(Math.floor(320 / cols), 1, 28), fitH = clamp(Math.floor(320 / rows), 1, 28);
      var sq = Math.min(fitW, fitH);
      var cw = cols * sq < 48 ? Math.min(fitW, Math.ceil(48 / cols)) : sq;
      var minH = rows === self.T && rows <= 32 ? rows * 10 : 48;  // room for token labels
      var ch = rows * sq < minH ? Math.min(fitH, Math.ceil(minH / rows)) : sq;
      var rowLabels = rows === self.T && ch >= 10;
      var lw = rowLabels ? 70 : 0;
      var w = Math.max(210, lw + cols * cw + 16), h = 46 + rows * ch + 12;
      if (x + w > maxW && x > 0) { x = 0; y += rowH + 14; rowH = 0; }
      cards.push({ st: st, x: x, y: y, w: w, h: h, cw: cw, ch: ch, rows: rows, cols: cols, lw: lw });
      x += w + 14; rowH = Math.max(rowH, h);
    });
    var W = maxW + 20, Hh = y + rowH + 20;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    var heads = this.stepHeads.length ? "head " + s.stepHead + " (per-head steps); whole-layer steps as they are" : "";
    svg.appendChild(sv("text", { x: 10, y: 18, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      "Self-attention step by step" + (heads ? ": " + heads : "")));
    cards.forEach(function (c, k) {
      var g = sv("g", { "class": "al-step", "data-name": c.st.name, transform: "translate(" + (10 + c.x) + "," + c.y + ")" });
      g.appendChild(sv("rect", { x: 0, y: 0, width: c.w, height: c.h, rx: 6, fill: "#f5f7fa", stroke: "#d8dce4" }));
      var shape = "(" + c.st.shape.join(", ") + (c.st.shape.length === 1 ? "," : "") + ")";
      var title = sv("text", { x: 8, y: 17, "font-size": 13, "font-weight": 600, fill: "#1d2330" }, (k + 1) + ". " + c.st.name + " ");
      var sh = sv("tspan", { "font-weight": 400, fill: "#2f5dd0" }, shape);
      title.appendChild(sh);
      g.appendChild(title);
      g.appendChild(sv("text", { x: 8, y: 33, "font-size": 10.5, fill: "#5b6475" }, shortDesc(c.st.description, c.w)));
      if (c.st.description) g.appendChild(sv("title", null, c.st.description));
      self.matrix(g, c.st, 8 + c.lw, 42, c.cw, c.ch, c.rows, c.cols, c.lw ? tokens : null);
      svg.appendChild(g);
    });
    return svg;
  };

  function shortDesc(d, w) {
    var n = Math.floor((w - 16) / 5.6);
    return d.length > n ? d.slice(0, n - 1) + "\u2026" : d;
  }

  Report.prototype.matrix = function (g, st, x0, y0, cw, ch, rows, cols, rowTokens) {
    var vals = this.arrays[st.array], self = this;
    var weights = st.name === "weights";
    var mx = 0;
    for (var k = 0; k < vals.length; k++) if (isFinite(vals[k])) mx = Math.max(mx, Math.abs(vals[k]));
    var inv = mx > 0 ? 1 / mx : 0;
    var table = weights ? SEQ : DIV;
    var levelOf = function (i, j) {
      var v = vals[i * cols + j];
      if (!isFinite(v)) return -1;
      if (weights) return Math.round(clamp(v * inv, 0, 1) * 255);
      return Math.round((clamp(v * inv, -1, 1) + 1) / 2 * 255);
    };
    var W = cols * cw, H = rows * ch;
    g.appendChild(sv("image", { x: x0, y: y0, width: W, height: H, preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated", href: matrixImage(rows, cols, table, levelOf) }));
    if (cw >= 24 && ch >= 24) {
      var t = sv("g", { "font-size": 8.5, "text-anchor": "middle", "pointer-events": "none" });
      for (var i = 0; i < rows; i++) for (var j = 0; j < cols; j++) {
        var v = vals[i * cols + j], o = levelOf(i, j) * 3;
        var dark = o >= 0 && (table[o] * 0.3 + table[o + 1] * 0.59 + table[o + 2] * 0.11) < 120;
        t.appendChild(sv("text", { x: x0 + (j + 0.5) * cw, y: y0 + (i + 0.5) * ch, "dominant-baseline": "central",
          fill: dark ? "#fff" : "#1d2330" }, isFinite(v) ? v.toFixed(2) : fmt(v)));
      }
      g.appendChild(t);
    }
    if (rowTokens) {
      var rl = sv("g", { "font-size": clamp(ch - 3, 8, 11), fill: "#1d2330", "text-anchor": "end" });
      for (i = 0; i < rows; i++) rl.appendChild(sv("text", { x: x0 - 4, y: y0 + (i + 0.5) * ch, "dominant-baseline": "central" }, short(rowTokens[i], 10)));
      g.appendChild(rl);
    }
    g.appendChild(sv("rect", { x: x0, y: y0, width: W, height: H, fill: "none", stroke: "#c4c9d3" }));
    var hit = sv("rect", { "class": "al-hit", x: x0, y: y0, width: W, height: H, fill: "transparent" });
    g.appendChild(hit);
    var T = this.T;
    this.hover(hit, rows, cols, function (i, j) {
      var who = rows === T ? " \u201c" + short(self.tokens[i], 24) + "\u201d" : "";
      return st.name + "[" + i + ", " + j + "]" + who + "\n" + fmt(vals[i * cols + j]);
    });
  };

  /* ------------------------------------------------------------------ embedding view */

  Report.prototype.embeddingView = function () {
    var e = this.data.embedding, tokens = this.tokens, self = this, T = this.T;
    var joint = e.joint;
    var pw = joint ? 760 : 520, ph = 500, gap = 30;
    var W = joint ? pw + 110 : pw * 2 + gap + 110, Hh = ph + 76;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    var pct = function (x) { return (100 * x).toFixed(0) + "%"; };
    svg.appendChild(sv("text", { x: 20, y: 18, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      joint ? "Static \u2192 contextual token vectors (PCA fitted on the static vectors: PC1 " + pct(e.explained[0]) +
        ", PC2 " + pct(e.explained[1]) + " of the variance)"
        : "Static and contextual vectors have different widths: each set has its own PCA"));
    var legend = sv("g", { "font-size": 11, fill: "#5b6475" });
    legend.appendChild(sv("circle", { cx: 26, cy: 36, r: 4.5, fill: "#fff", stroke: "#6b6b6b", "stroke-width": 1.5 }));
    legend.appendChild(sv("text", { x: 36, y: 36, "dominant-baseline": "central" }, "static (before attention)"));
    legend.appendChild(sv("circle", { cx: 206, cy: 36, r: 4.5, fill: "#2f5dd0" }));
    legend.appendChild(sv("text", { x: 216, y: 36, "dominant-baseline": "central" }, "contextual (after the last layer)"));
    svg.appendChild(legend);
    var panels = joint ? [[e.static, e.contextual, 20]] : [[e.static, null, 20], [null, e.contextual, 20 + pw + gap]];
    var hl = [];
    panels.forEach(function (p) {
      var pts = (p[0] || []).concat(p[1] || []);
      var xs = pts.map(function (q) { return q[0]; }), ys = pts.map(function (q) { return q[1]; });
      var xmin = Math.min.apply(null, xs), xmax = Math.max.apply(null, xs);
      var ymin = Math.min.apply(null, ys), ymax = Math.max.apply(null, ys);
      var dx = (xmax - xmin) || 1, dy = (ymax - ymin) || 1;
      var ox = p[2], oy = 56, m = 24;
      var X = function (v) { return ox + m + (v - xmin) / dx * (pw - 2 * m); };
      var Y = function (v) { return oy + ph - m - (v - ymin) / dy * (ph - 2 * m); };
      var g = sv("g");
      g.appendChild(sv("rect", { x: ox, y: oy, width: pw, height: ph, fill: "#fff", stroke: "#d8dce4" }));
      g.appendChild(sv("text", { x: ox + pw / 2, y: oy + ph + 12, "text-anchor": "middle", "font-size": 11, fill: "#5b6475" }, "PC1"));
      g.appendChild(sv("text", { x: ox - 6, y: oy + ph / 2, "text-anchor": "middle", "font-size": 11, fill: "#5b6475",
        transform: "rotate(-90 " + (ox - 6) + " " + (oy + ph / 2) + ")" }, "PC2"));
      if (p[0] && p[1]) {
        var arrows = sv("g", { stroke: "#9aa3b5", "stroke-width": 1, "stroke-opacity": 0.8 });
        for (var i = 0; i < T; i++) {
          arrows.appendChild(sv("line", { x1: X(p[0][i][0]), y1: Y(p[0][i][1]), x2: X(p[1][i][0]), y2: Y(p[1][i][1]) }));
        }
        g.appendChild(arrows);
      }
      var dots = sv("g");
      [0, 1].forEach(function (kind) {
        var set = p[kind];
        if (!set) return;
        for (var i = 0; i < T; i++) {
          var c = sv("circle", { cx: X(set[i][0]).toFixed(1), cy: Y(set[i][1]).toFixed(1), r: T > 120 ? 3.5 : 4.5,
            "data-idx": String(i), "data-kind": String(kind), "class": "al-dot" });
          if (kind === 0) { c.setAttribute("fill", "#fff"); c.setAttribute("stroke", "#6b6b6b"); c.setAttribute("stroke-width", 1.5); }
          else { c.setAttribute("fill", "#2f5dd0"); c.setAttribute("fill-opacity", 0.85); }
          dots.appendChild(c);
          hl.push(c);
        }
      });
      g.appendChild(dots);
      if (T <= 60) {
        var lab = sv("g", { "font-size": 11, fill: "#1d2330", "pointer-events": "none" });
        var set = p[1] || p[0];
        for (var i2 = 0; i2 < T; i2++) {
          lab.appendChild(sv("text", { x: X(set[i2][0]) + 6, y: Y(set[i2][1]) - 6 }, short(tokens[i2], 16)));
        }
        g.appendChild(lab);
      }
      svg.appendChild(g);
    });
    svg.addEventListener("mousemove", function (ev) {
      var c = ev.target;
      if (!c.classList || !c.classList.contains("al-dot")) { self.hideTip(); hl.forEach(function (d) { d.style.opacity = ""; }); return; }
      var i = Number(c.getAttribute("data-idx"));
      hl.forEach(function (d) { d.style.opacity = Number(d.getAttribute("data-idx")) === i ? "1" : "0.25"; });
      var sx = e.static[i], cx = e.contextual[i];
      self.showTip(ev, "token " + i + " \u201c" + short(tokens[i], 40) + "\u201d\nstatic (" + fmt(sx[0]) + ", " + fmt(sx[1]) +
        ")\ncontextual (" + fmt(cx[0]) + ", " + fmt(cx[1]) + ")");
    });
    svg.addEventListener("mouseleave", function () { self.hideTip(); hl.forEach(function (d) { d.style.opacity = ""; }); });
    return svg;
  };

  /* ------------------------------------------------------------------ export */

  Report.prototype.fileName = function (ext) {
    var s = this.state, name = "attnlab-" + s.view;
    if (s.view === "head" || s.view === "heatmap") name += "-layer" + (s.layer + 1);
    if (s.view === "heatmap") name += "-head" + s.head;
    if (s.view === "steps") name += "-head" + s.stepHead;
    return name + "." + ext;
  };

  Report.prototype.svgText = function () {
    var svg = this.stage.querySelector("svg").cloneNode(true);
    svg.setAttribute("xmlns", NS);
    svg.setAttribute("font-family", FONT);
    svg.insertBefore(sv("rect", { x: 0, y: 0, width: "100%", height: "100%", fill: "#ffffff" }), svg.firstChild);
    var hits = svg.querySelectorAll(".al-hit");
    for (var k = 0; k < hits.length; k++) hits[k].parentNode.removeChild(hits[k]);
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + new XMLSerializer().serializeToString(svg);
  };

  Report.prototype.download = function (blob, name) {
    var url = URL.createObjectURL(blob);
    var a = el("a", { href: url, download: name });
    a.style.display = "none";
    this.root.appendChild(a);
    a.click();
    this.root.removeChild(a);
    setTimeout(function () { URL.revokeObjectURL(url); }, 30000);
  };

  Report.prototype.exportSVG = function () {
    this.download(new Blob([this.svgText()], { type: "image/svg+xml" }), this.fileName("svg"));
  };

  Report.prototype.exportPNG = function () {
    var self = this, svg = this.stage.querySelector("svg");
    var w = Number(svg.getAttribute("width")), h = Number(svg.getAttribute("height"));
    var scale = Math.min(2, 16000 / Math.max(w, h), Math.sqrt(60e6 / (w * h)));
    var img = new Image();
    var name = this.fileName("png");
    img.onload = function () {
      var cv = document.createElement("canvas");
      cv.width = Math.max(1, Math.round(w * scale)); cv.height = Math.max(1, Math.round(h * scale));
      var ctx = cv.getContext("2d");
      ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, cv.width, cv.height);
      ctx.drawImage(img, 0, 0, cv.width, cv.height);
      cv.toBlob(function (b) {
        if (b) self.download(b, name);
        self.root.setAttribute("data-exported", name);
      }, "image/png");
    };
    img.onerror = function () { self.root.setAttribute("data-exported", "error"); };
    img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(this.svgText());
  };

  /* ------------------------------------------------------------------ start */

  var roots = document.querySelectorAll(".attnlab-report");
  for (var r = 0; r < roots.length; r++) {
    if (roots[r].getAttribute("data-started")) continue;
    roots[r].setAttribute("data-started", "1");
    start(roots[r]);
  }
})();
