/* attnlab interactive attention report.
 *
 * Starts every `.attnlab-report` element on the page that has not started yet (a Jupyter
 * notebook may hold several), now and whenever `window.attnlabReport.start()` is called (a
 * notebook's later views carry only that call: the script comes once per page). An element
 * with `data-view-only="head"` (or another view) shows that one view, without tabs or notes.
 * Each one carries its data in a
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
    ["steps", "Steps"], ["embedding", "Embeddings"], ["lens", "Logit lens"],
    ["detectors", "Head detectors"], ["patching", "Patching"], ["rollout", "Rollout"],
    ["attribution", "Input attribution"], ["atp", "AtP vs patching"], ["circuit", "Circuit"]
  ];
  // Why a tab is off when the explanation has no data for it.
  var MISSING = {
    steps: "no step-by-step trace in this explanation (attnlab explain --steps records one)",
    lens: "only decoders have a logit lens (attnlab explain --model smollm2, the bundled decoder; or a decoder's --checkpoint)",
    detectors: "only decoders get head detector scores (attnlab explain --model smollm2, the bundled decoder; or a decoder's --checkpoint)",
    patching: "no activation patching in this explanation (attnlab explain --corrupt TEXT records one)",
    rollout: "attention rollout is drawn for encoders (attnlab explain --model minilm)",
    attribution: "no input attribution in this explanation (attnlab explain --attribute records one)",
    atp: "no attribution patching in this explanation (attnlab explain --attribute --corrupt TEXT records one)",
    circuit: "no circuit in this explanation (attnlab explain --attribute --corrupt TEXT finds one with EAP-IG)"
  };
  var KIND_NAMES = { previous_token: "previous-token heads", duplicate_token: "duplicate-token heads",
    induction: "induction heads" };
  var LENS_WINDOW = 64;  // positions the lens view shows at a time

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
  /* Text as XML 1.0 allows it (an exported SVG must parse): C0 controls and DEL become their
     "control pictures", lone surrogates and U+FFFE/U+FFFF the replacement character. */
  function xmlSafe(s) {
    return String(s).replace(/[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f]/g, function (c) {
      return c === "\u007f" ? "\u2421" : String.fromCharCode(0x2400 + c.charCodeAt(0));
    }).replace(/[\ud800-\udfff\ufffe\uffff]/gu, "\ufffd");
  }
  function show(tok) {
    if (tok === "") return "\u2205";
    var s = xmlSafe(tok.replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5").replace(/\r/g, "\u21b5"));
    if (/^\s+$/.test(s)) s = s.replace(/ /g, "\u2423");
    return s;
  }
  /* At most n characters (whole code points: an emoji is never cut in half). */
  function short(tok, n) {
    var cs = Array.from(show(tok));
    return cs.length > n ? cs.slice(0, n - 1).join("") + "\u2026" : cs.join("");
  }
  var measureCtx = null;
  function textWidth(text, px) {
    if (!measureCtx) measureCtx = document.createElement("canvas").getContext("2d");
    measureCtx.font = px + "px " + FONT;
    return measureCtx.measureText(text).width;
  }
  /* Lines of at most maxW pixels (words kept whole where they fit). */
  function wrapText(text, maxW, px) {
    var lines = [], line = "";
    String(text).split(/\s+/).forEach(function (word) {
      if (!word) return;
      var next = line ? line + " " + word : word;
      if (!line || textWidth(next, px) <= maxW) { line = next; return; }
      lines.push(line); line = word;
    });
    if (line) lines.push(line);
    return lines;
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
      out[k] = r.dtype === "u8" ? new Uint8Array(buf, r.offset, n) : r.dtype === "u16" ? new Uint16Array(buf, r.offset, n) :
        r.dtype === "u32" ? new Uint32Array(buf, r.offset, n) : new Float32Array(buf, r.offset, n);
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
      new Report(root, app, data, arrays, root.getAttribute("data-view-only"));
      root.setAttribute("data-render-ms", (performance.now() - t0).toFixed(1));
      root.setAttribute("data-ready-at-ms", performance.now().toFixed(1));
      root.setAttribute("data-ready", "1");
    }).catch(function (e) {
      fail(app, "cannot decode the data: " + (e && e.message ? e.message : e));
      root.setAttribute("data-ready", "error");
    });
  }

  /* ------------------------------------------------------------------ the report */

  function Report(root, app, data, arrays, only) {
    var self = this;
    this.root = root; this.app = app; this.data = data; this.only = only || null;
    this.T = data.T; this.L = data.layers; this.H = data.heads; this.tokens = data.tokens;
    this.codes = arrays.attn; this.rowmax = arrays.rowmax; this.arrays = arrays;
    if (data.arrays.rowmax.dtype === "u16") this.rowmax = Float32Array.from(arrays.rowmax, function (v) { return v / 65535; });
    this.levels = data.levels || 255;  // the largest attention code (255: 8 bits)
    this.thumbs = {};
    var stepHeads = {};
    data.steps.forEach(function (s) { if (s.head !== null) stepHeads[s.head] = true; });
    this.stepHeads = Object.keys(stepHeads).map(Number).sort(function (a, b) { return a - b; });
    this.state = {
      view: only || "head", layer: data.layer || 0, head: data.head || 0, heads: [], gain: 1,
      stepHead: this.stepHeads.indexOf(data.head || 0) >= 0 ? (data.head || 0) : (this.stepHeads.length ? this.stepHeads[0] : 0),
      lo: 0
    };
    // A long text is shown `window` tokens at a time: drawing them all would freeze the page.
    this.W = data.window ? Math.min(data.window, this.T) : this.T;
    for (var h = 0; h < this.H; h++) this.state.heads.push(true);

    app.replaceChildren();
    if (this.W < this.T) {
      app.appendChild(el("p", { "class": "al-warn", role: "note" }, "This text has " + this.T + " tokens, too " +
        "many to draw at once: every view shows " + this.W + " of them at a time (move the window with " +
        "\u201cTokens\u201d); attention between tokens in different windows is not drawn."));
    }
    if (data.notes.length && !this.only) {
      var ul = el("ul", { "class": "al-notes" });
      data.notes.forEach(function (n) { ul.appendChild(el("li", null, n)); });
      app.appendChild(ul);
    }
    var tabs = el("div", { "class": "al-tabs", role: "tablist" });
    this.tabButtons = {};
    VIEWS.forEach(function (v) {
      var b = el("button", { "class": "al-tab", role: "tab", type: "button", "data-view": v[0] }, v[1]);
      var A = data.attribution;
      var has = { steps: data.steps.length > 0, lens: !!data.lens, detectors: !!data.detectors, patching: !!data.patching,
        rollout: !!data.rollout, attribution: !!A, atp: !!(A && A.atp), circuit: !!(A && A.circuit) };
      if (v[0] in has && !has[v[0]]) {
        b.disabled = true;
        b.title = MISSING[v[0]];
      }
      b.addEventListener("click", function () { self.set({ view: v[0] }); });
      self.tabButtons[v[0]] = b;
      tabs.appendChild(b);
    });
    if (!this.only) app.appendChild(tabs);
    this.controls = el("div", { "class": "al-controls" });
    this.hint = el("p", { "class": "al-hint" });
    this.stage = el("div", { "class": "al-stage" });
    this.tip = el("div", { "class": "al-tip", role: "status" });
    var bits = Math.round(Math.log2(this.levels + 1));
    this.foot = el("p", { "class": "al-foot" },
      "Attention weights are stored with " + bits + " bits per value relative to each row's maximum " +
      "(error at most " + +(50 / this.levels).toPrecision(2) + "% of that maximum). The file makes no network request.");
    app.appendChild(this.controls);
    app.appendChild(this.hint);
    app.appendChild(this.stage);
    if (!this.only) app.appendChild(this.foot);
    root.appendChild(this.tip);
    this.render();
  }

  Report.prototype.value = function (l, h, i, j) {
    var r = (l * this.H + h) * this.T + i;
    return this.codes[r * this.T + j] * this.rowmax[r] / this.levels;
  };

  /* How many tokens the current view shows at a time (the lens view fewer: text in each cell). */
  Report.prototype.span = function () {
    return this.state.view === "lens" ? Math.min(this.W, LENS_WINDOW) : this.W;
  };

  /* The tokens shown: [lo, hi). */
  Report.prototype.win = function () {
    var n = this.span(), lo = clamp(this.state.lo, 0, Math.max(0, this.T - n));
    return [lo, lo + n];
  };

  Report.prototype.set = function (patch) {
    if (this.only && "view" in patch && patch.view !== this.only) delete patch.view;  // one view: it stays
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
    else if (s.view === "lens") svg = this.lensView();
    else if (s.view === "detectors") svg = this.detectorsView();
    else if (s.view === "patching") svg = this.patchingView();
    else if (s.view === "rollout") svg = this.rolloutView();
    else if (s.view === "attribution") svg = this.attributionView();
    else if (s.view === "atp") svg = this.atpView();
    else if (s.view === "circuit") svg = this.circuitView();
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
      steps: "One attention call step by step, as the model computed it. Point at a cell for its value. Click a colour to pick the head.",
      embedding: "Token vectors before attention (hollow) and after (filled), projected on their first two principal components. Point at a token for its name.",
      lens: "The likeliest next token at each position, read from the residual stream after each layer (through the final norm and the unembedding); darker = more probable, bold = the token that does come next. Point at a cell for the top tokens.",
      detectors: "How much each head attends like a previous-token, duplicate-token or induction head (0 to 1), on this text. Rows: blocks, counted from 0 as in the hook names (block i makes layer i + 1). Click a cell to open that head.",
      rollout: "Attention rollout (Abnar & Zuidema): how much each token's vector after the chosen layer draws on each input token, through every layer up to it (heads averaged, the residual counted as attention to itself). Rows: tokens after the layer, columns: input tokens.",
      patching: "Each cell: the metric when the corrupted text runs with one residual vector (entering block i, at one position) taken from the clean text. Red: it restores the clean prediction, white: no effect. Point at a cell for its value.",
      attribution: "Each token shaded by how much it pushed the model towards its predicted next token (integrated gradients of that token's log-probability, summed over the embedding's dimensions): red towards, blue away. Point at a token for its score.",
      atp: "Left: activation patching's effect (one forward pass per cell). Right: attribution patching's estimate of the same numbers from one backward pass (the gradient at the corrupted run). One colour scale for both; where they differ, the model is not linear over that patch (often saturated attention). Point at a cell for both values.",
      circuit: "The edges that edge attribution (EAP-IG) scores highest, pruned to those on a path from the input to the logits: heads (a block.h head) and MLPs (m block) by block. Red: the edge carries the clean behaviour, blue: against it; thicker = larger score; q solid, k dashed, v dotted. Point at an edge for its score."
    };
    this.hint.textContent = hints[s.view];

    if (s.view === "head" || s.view === "heatmap" || s.view === "rollout") {
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
    if (this.span() < this.T && s.view !== "steps" && s.view !== "detectors") {
      var w = this.win(), T = this.T, W = this.span(), step = Math.max(1, Math.floor(W / 2));
      var wl = el("label", null, "Tokens ");
      var prev = el("button", { type: "button", "class": "al-btn al-win-prev", "aria-label": "earlier tokens" }, "\u25c0");
      var start = el("input", { type: "number", "class": "al-win-start", min: "0", max: String(T - W), step: String(step),
        value: String(w[0]), "aria-label": "first token shown" });
      var next = el("button", { type: "button", "class": "al-btn al-win-next", "aria-label": "later tokens" }, "\u25b6");
      var info = el("span", { "class": "al-win-info" }, w[0] + "\u2013" + (w[1] - 1) + " of " + T);
      prev.disabled = w[0] === 0; next.disabled = w[1] >= T;
      prev.addEventListener("click", function () { self.set({ lo: Math.max(0, w[0] - step) }); });
      next.addEventListener("click", function () { self.set({ lo: Math.min(T - W, w[0] + step) }); });
      start.addEventListener("change", function () {
        var v = Math.round(Number(start.value));
        self.set({ lo: clamp(v === v ? v : 0, 0, T - W) });
      });
      wl.appendChild(prev); wl.appendChild(start); wl.appendChild(next); wl.appendChild(info);
      c.appendChild(wl);
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
    var self = this, s = this.state, tokens = this.tokens;
    var w = this.win(), lo = w[0], hi = w[1], n = hi - lo;
    var rowH = n <= 40 ? 22 : n <= 120 ? 17 : 14;
    var fs = clamp(rowH - 7, 9, 14);
    var longest = 0;
    for (var t = lo; t < hi; t++) longest = Math.max(longest, Math.min(18, show(tokens[t]).length));
    var labelW = clamp(longest * fs * 0.62 + 14, 44, 180);
    var gap = 360, pad = 12, top = 44;
    var W = pad * 2 + labelW * 2 + gap, Hh = top + n * rowH + pad;
    var x1 = pad + labelW, x2 = pad + labelW + gap;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    var visible = [];
    s.heads.forEach(function (on, h) { if (on) visible.push(h); });
    svg.appendChild(sv("text", { x: pad, y: 15, "font-size": 12, fill: "#1d2330", "font-weight": 600 },
      "layer " + (s.layer + 1) + ", heads " + (visible.length ? compact(visible) : "none") +
      (n < this.T ? ", tokens " + lo + "\u2013" + (hi - 1) + " of " + this.T : "")));
    svg.appendChild(sv("text", { x: x1 - 4, y: 33, "text-anchor": "end", "font-size": 11, fill: "#5b6475" }, "query"));
    svg.appendChild(sv("text", { x: x2 + 4, y: 33, "text-anchor": "start", "font-size": 11, fill: "#5b6475" }, "key"));
    var lines = sv("g", { "class": "al-lines", fill: "none", "stroke-linecap": "round" });
    svg.appendChild(lines);
    var ys = function (i) { return top + (i - lo) * rowH + rowH / 2; };

    var draw = function (only) {
      lines.replaceChildren();
      visible.forEach(function (h) { self.headPaths(lines, s.layer, h, only, x1 + 3, x2 - 3, ys, lo, hi); });
    };
    draw(null);

    var labels = sv("g", { "font-size": fs });
    var marks = [[], []];
    [0, 1].forEach(function (side) {
      for (var i = lo; i < hi; i++) {
        var y = top + (i - lo) * rowH;
        var g = sv("g", { "class": "al-tok", "data-side": String(side), "data-idx": String(i) });
        var bg = sv("rect", { x: side ? x2 : pad, y: y + 1, width: labelW, height: rowH - 2, rx: 3,
          fill: "#2f5dd0", "fill-opacity": 0 });
        var tx = sv("text", { x: side ? x2 + 4 : x1 - 4, y: y + rowH / 2, "dominant-baseline": "central",
          "text-anchor": side ? "start" : "end", fill: "#1d2330" }, short(tokens[i], 18));
        g.appendChild(bg); g.appendChild(tx);
        g.appendChild(sv("title", null, "token " + i + ": " + show(tokens[i])));
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
      for (var k = lo; k < hi; k++) {
        var v = h0 < 0 ? 0 : side === 0 ? self.value(s.layer, h0, i, k) : self.value(s.layer, h0, k, i);
        marks[1 - side][k - lo].setAttribute("fill-opacity", (0.6 * v).toFixed(3));
        marks[side][k - lo].setAttribute("fill-opacity", k === i ? "0.18" : "0");
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
  Report.prototype.headPaths = function (parent, l, h, only, xa, xb, ys, lo, hi) {
    var T = this.T, gain = this.state.gain, min = only ? 0.004 : 0.02;
    var base = (l * this.H + h) * T, codes = this.codes, rowmax = this.rowmax;
    var counts = new Array(LEVELS).fill(0);
    var i0 = lo, i1 = hi, j0 = lo, j1 = hi;
    if (only && only.side === 0) { i0 = only.idx; i1 = i0 + 1; }
    if (only && only.side === 1) { j0 = only.idx; j1 = j0 + 1; }
    var i, j, w, lv;
    for (i = i0; i < i1; i++) {
      var sc = rowmax[base + i] * gain / this.levels, off = (base + i) * T;
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
      var sc2 = rowmax[base + i] * gain / this.levels, off2 = (base + i) * T, y1 = ys(i).toFixed(1);
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
    var w = this.win(), lo = w[0], m = w[1] - w[0];
    var key = l + "," + h + "," + n + "," + lo;
    if (this.thumbs[key]) return this.thumbs[key];
    var T = this.T, codes = this.codes, rowmax = this.rowmax, base = (l * this.H + h) * T;
    // max-pool the window's m x m map to n x n, then scale to its own maximum
    var pooled = new Float32Array(n * n), mx = 0;
    for (var a = 0; a < n; a++) {
      var ia = lo + Math.floor(a * m / n), ib = lo + Math.max(Math.floor(a * m / n) + 1, Math.floor((a + 1) * m / n));
      for (var i = ia; i < ib; i++) {
        var sc = rowmax[base + i] / this.levels, off = (base + i) * T;
        for (var b = 0; b < n; b++) {
          var ja = lo + Math.floor(b * m / n), jb = lo + Math.max(Math.floor(b * m / n) + 1, Math.floor((b + 1) * m / n));
          var best = 0;
          for (var j = ja; j < jb; j++) if (codes[off + j] > best) best = codes[off + j];
          var v = best * sc;
          if (v > pooled[a * n + b]) pooled[a * n + b] = v;
          if (v > mx) mx = v;
        }
      }
    }
    var inv = mx > 0 ? 255 / mx : 0;
    var url = matrixImage(n, n, SEQ, function (i, j) { return Math.round(pooled[i * n + j] * inv); });
    this.thumbs[key] = url;
    return url;
  };

  Report.prototype.modelView = function () {
    var self = this, s = this.state, L = this.L, H = this.H, w = this.win();
    var cell = clamp(Math.floor(1040 / H) - 8, 34, 88);
    var n = Math.min(w[1] - w[0], cell);
    var left = 64, top = 44, gapc = 8;
    var W = Math.max(240, left + H * (cell + gapc) + 12), Hh = top + L * (cell + gapc) + 12;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: left, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      L + " layer(s) \u00d7 " + H + " head(s)" +
      (this.W < this.T ? ", tokens " + w[0] + "\u2013" + (w[1] - 1) + " of " + this.T : "")));
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
    var self = this, s = this.state, tokens = this.tokens, l = s.layer, h = s.head;
    var w = this.win(), lo = w[0], T = w[1] - w[0];  // the window's tokens; i, j count from lo
    var cell = clamp(640 / T, 1, 30);
    var size = cell * T;
    var labels = cell >= 9;
    var step = labels ? 1 : Math.ceil(10 / cell);
    var fs = clamp(Math.floor(cell) - 2, 9, 12);
    var longest = 0;
    for (var t = lo; t < lo + T; t++) longest = Math.max(longest, Math.min(14, show(tokens[t]).length));
    var lab = clamp(longest * fs * 0.62 + (labels ? 10 : 34), 40, 140);
    var left = lab + 8, top = lab + 30, barW = 14;
    var W = Math.max(380, left + size + 80), Hh = top + size + 16;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      "layer " + (l + 1) + ", head " + h + " (rows: queries, columns: keys)" +
      (T < this.T ? ", tokens " + lo + "\u2013" + (lo + T - 1) + " of " + this.T : "")));
    var val = function (i, j) { return self.value(l, h, lo + i, lo + j); };
    var mx = 0;
    for (var i = 0; i < T; i++) for (var j = 0; j < T; j++) mx = Math.max(mx, val(i, j));
    var inv = mx > 0 ? 255 / mx : 0;
    svg.appendChild(sv("image", { x: left, y: top, width: size, height: size, preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated",
      href: matrixImage(T, T, SEQ, function (i, j) { return Math.round(val(i, j) * inv); }) }));
    if (T <= 16) {
      var vals = sv("g", { "font-size": clamp(cell * 0.34, 8, 11), "text-anchor": "middle", "pointer-events": "none" });
      for (i = 0; i < T; i++) for (j = 0; j < T; j++) {
        var v = val(i, j);
        vals.appendChild(sv("text", { x: left + (j + 0.5) * cell, y: top + (i + 0.5) * cell, "dominant-baseline": "central",
          fill: v * inv > 150 ? "#fff" : "#1d2330" }, v.toFixed(2)));
      }
      svg.appendChild(vals);
    }
    var ticks = sv("g", { "font-size": fs, fill: "#1d2330" });
    for (i = 0; i < T; i += step) {
      var name = labels ? short(tokens[lo + i], 14) : (lo + i) + " " + short(tokens[lo + i], 8);
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
      return "query " + (lo + i) + " \u201c" + short(tokens[lo + i], 30) + "\u201d \u2192 key " + (lo + j) + " \u201c" +
        short(tokens[lo + j], 30) + "\u201d\nweight " + val(i, j).toFixed(4);
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
      var w = Math.max(210, lw + cols * cw + 16);
      var desc = st.description ? wrapText(st.description, w - 16, 10.5) : [];
      var extra = Math.max(0, desc.length - 1) * 13;
      var h = 46 + extra + rows * ch + 12;
      if (x + w > maxW && x > 0) { x = 0; y += rowH + 14; rowH = 0; }
      cards.push({ st: st, x: x, y: y, w: w, h: h, cw: cw, ch: ch, rows: rows, cols: cols, lw: lw, desc: desc, extra: extra });
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
      c.desc.forEach(function (line, k) {
        g.appendChild(sv("text", { "class": "al-desc", x: 8, y: 33 + 13 * k, "font-size": 10.5, fill: "#5b6475" }, line));
      });
      self.matrix(g, c.st, 8 + c.lw, 42 + c.extra, c.cw, c.ch, c.rows, c.cols, c.lw ? tokens : null);
      svg.appendChild(g);
    });
    return svg;
  };

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

  /* ------------------------------------------------------------------ logit lens view */

  /* Layers 0..n (rows) x the window's positions (columns): the likeliest next token in each
     cell, shaded by its probability. */
  Report.prototype.lensView = function () {
    var self = this, tokens = this.tokens, lens = this.data.lens, K = lens.k, R = this.L + 1, T = this.T;
    var index = this.arrays.lens_index, probs = this.arrays.lens_p;
    var w = this.win(), lo = w[0], n = w[1] - w[0];
    var at = function (r, t, k) { return (r * T + t) * K + (k || 0); };
    var word = function (r, t, k) { return lens.strings[index[at(r, t, k)]]; };
    var fs = 11, longest = 3;
    for (var r = 0; r < R; r++) for (var t = lo; t < lo + n; t++) longest = Math.max(longest, Math.min(10, show(word(r, t)).length));
    for (t = lo; t < lo + n; t++) longest = Math.max(longest, Math.min(10, show(tokens[t]).length));
    var cw = clamp(longest * fs * 0.62 + 10, 34, 84), ch = 22;
    var left = 150, top = 76, size = [n * cw, R * ch];
    var title = "Logit lens: the likeliest next token after each layer (layer 0 = the embeddings, layer k = the output of block k \u2212 1)" +
      (n < T ? ", tokens " + lo + "\u2013" + (lo + n - 1) + " of " + T : "");
    var W = Math.max(420, left + size[0] + 70, textWidth(title, 12) + 24), Hh = top + size[1] + 40;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, title));
    svg.appendChild(sv("text", { x: 8, y: 32, "font-size": 11, fill: "#5b6475" },
      "bold: the token that does come next in the text; the last row is the model's own prediction"));
    svg.appendChild(sv("image", { x: left, y: top, width: size[0], height: size[1], preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated",
      href: matrixImage(R, n, SEQ, function (i, j) { return Math.round(clamp(probs[at(i, lo + j)], 0, 1) * 255); }) }));
    var head = sv("g", { "font-size": fs, "text-anchor": "middle" });
    for (var j = 0; j < n; j++) {
      var cx = left + (j + 0.5) * cw;
      head.appendChild(sv("text", { x: cx, y: top - 22, fill: "#8a93a3", "font-size": 9.5 }, String(lo + j)));
      head.appendChild(sv("text", { "class": "al-lens-input", x: cx, y: top - 8, fill: "#1d2330" }, short(tokens[lo + j], 10)));
    }
    svg.appendChild(head);
    var rows = sv("g", { "font-size": fs, fill: "#5b6475", "text-anchor": "end" });
    for (r = 0; r < R; r++) {
      var name = "layer " + r + (r === 0 ? " (embeddings)" : r === R - 1 ? " (output)" : "");
      rows.appendChild(sv("text", { x: left - 6, y: top + (r + 0.5) * ch, "dominant-baseline": "central" }, name));
    }
    svg.appendChild(rows);
    var cells = sv("g", { "class": "al-lens-cells", "font-size": fs, "text-anchor": "middle", "pointer-events": "none" });
    for (r = 0; r < R; r++) {
      for (j = 0; j < n; j++) {
        var t2 = lo + j, p = probs[at(r, t2)], lv = Math.round(clamp(p, 0, 1) * 255) * 3;
        var dark = (SEQ[lv] * 0.3 + SEQ[lv + 1] * 0.59 + SEQ[lv + 2] * 0.11) < 120;
        var right = t2 + 1 < T && word(r, t2) === tokens[t2 + 1];
        var attrs = { "class": "al-lens-cell", x: left + (j + 0.5) * cw, y: top + (r + 0.5) * ch, "dominant-baseline": "central",
          fill: dark ? "#fff" : "#1d2330", "data-row": String(r), "data-pos": String(t2) };
        if (right) { attrs["font-weight"] = 700; attrs["class"] += " al-lens-right"; }
        cells.appendChild(sv("text", attrs, short(word(r, t2), 10)));
      }
    }
    svg.appendChild(cells);
    svg.appendChild(sv("rect", { x: left, y: top, width: size[0], height: size[1], fill: "none", stroke: "#c4c9d3" }));
    svg.appendChild(sv("text", { x: left, y: top + size[1] + 18, "font-size": 11, fill: "#5b6475" },
      "shade: probability of the cell's token, white 0 to dark blue 1"));
    var mark = sv("rect", { width: cw, height: ch, fill: "none", stroke: "#e6550d", "stroke-width": 1.5,
      visibility: "hidden", "pointer-events": "none" });
    var hit = sv("rect", { "class": "al-hit", x: left, y: top, width: size[0], height: size[1], fill: "transparent" });
    svg.appendChild(hit);
    svg.appendChild(mark);
    this.hover(hit, R, n, function (i, j) {
      var t3 = lo + j, lines = [];
      for (var k = 0; k < K; k++) lines.push((k + 1) + ". \u201c" + short(word(i, t3, k), 30) + "\u201d " + probs[at(i, t3, k)].toFixed(3));
      var where = i === 0 ? "layer 0 (the embeddings)" : "layer " + i + " (the output of block " + (i - 1) + ")";
      var next = t3 + 1 < T ? ", next in the text \u201c" + short(tokens[t3 + 1], 24) + "\u201d" : "";
      return where + "\nposition " + t3 + " \u201c" + short(tokens[t3], 24) + "\u201d" + next + "\n" + lines.join("\n");
    }, function (i, j) {
      if (i < 0) { mark.setAttribute("visibility", "hidden"); return; }
      mark.setAttribute("x", left + j * cw); mark.setAttribute("y", top + i * ch);
      mark.setAttribute("visibility", "visible");
    });
    return svg;
  };

  /* ------------------------------------------------------------------ head detector view */

  /* One blocks x heads heatmap per kind of head; a click opens that head in the head view. */
  Report.prototype.detectorsView = function () {
    var self = this, kinds = Object.keys(this.data.detectors), L = this.L, H = this.H;
    var cell = clamp(Math.floor(300 / Math.max(L, H)), 12, 36), label = 62, gap = 34, pw = label + H * cell;
    var perRow = Math.max(1, Math.floor(1100 / (pw + gap)));
    var top = 50, ph = 44 + L * cell + 12;
    var nRows = Math.ceil(kinds.length / perRow);
    var W = Math.max(420, 20 + Math.min(kinds.length, perRow) * (pw + gap)), Hh = top + nRows * (ph + 16) + 10;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 10, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      "Head detector scores on this text (0 to 1; white 0, dark blue 1)"));
    svg.appendChild(sv("text", { x: 10, y: 32, "font-size": 11, fill: "#5b6475" },
      "rows: blocks counted from 0 as in the hook names (block i makes layer i + 1); columns: heads"));
    kinds.forEach(function (kind, k) {
      var scores = self.data.detectors[kind];
      var x0 = 10 + (k % perRow) * (pw + gap), y0 = top + Math.floor(k / perRow) * (ph + 16);
      var g = sv("g", { "class": "al-detector", "data-kind": kind });
      g.appendChild(sv("text", { x: x0, y: y0 + 12, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
        KIND_NAMES[kind] || kind));
      var mx = x0 + label, my = y0 + 40;
      g.appendChild(sv("image", { x: mx, y: my, width: H * cell, height: L * cell, preserveAspectRatio: "none",
        "image-rendering": "pixelated", style: "image-rendering:pixelated",
        href: matrixImage(L, H, SEQ, function (i, j) {
          var v = scores[i][j];
          return v === null ? -1 : Math.round(clamp(v, 0, 1) * 255);
        }) }));
      for (var h = 0; h < H; h++) {
        if (cell < 16 && h % Math.ceil(16 / cell)) continue;
        g.appendChild(sv("text", { x: mx + (h + 0.5) * cell, y: my - 5, "text-anchor": "middle", "font-size": 10,
          fill: headColor(h), "font-weight": 600 }, String(h)));
      }
      for (var i = 0; i < L; i++) {
        if (cell < 14 && i % Math.ceil(14 / cell)) continue;
        g.appendChild(sv("text", { x: mx - 5, y: my + (i + 0.5) * cell, "text-anchor": "end", "dominant-baseline": "central",
          "font-size": 10, fill: "#5b6475" }, "block " + i));
      }
      if (cell >= 28) {
        var vals = sv("g", { "font-size": 9, "text-anchor": "middle", "pointer-events": "none" });
        for (i = 0; i < L; i++) for (h = 0; h < H; h++) {
          var v = scores[i][h];
          vals.appendChild(sv("text", { x: mx + (h + 0.5) * cell, y: my + (i + 0.5) * cell, "dominant-baseline": "central",
            fill: v !== null && v > 0.55 ? "#fff" : "#1d2330" }, v === null ? "\u2013" : v.toFixed(2)));
        }
        g.appendChild(vals);
      }
      g.appendChild(sv("rect", { x: mx, y: my, width: H * cell, height: L * cell, fill: "none", stroke: "#c4c9d3" }));
      var hit = sv("rect", { "class": "al-hit", x: mx, y: my, width: H * cell, height: L * cell, fill: "transparent",
        style: "cursor:pointer" });
      g.appendChild(hit);
      var cellOf = function (ev) {
        var b = hit.getBoundingClientRect();
        return [clamp(Math.floor((ev.clientY - b.top) / b.height * L), 0, L - 1),
          clamp(Math.floor((ev.clientX - b.left) / b.width * H), 0, H - 1)];
      };
      self.hover(hit, L, H, function (i2, h2) {
        var v2 = scores[i2][h2];
        return (KIND_NAMES[kind] || kind) + "\nblock " + i2 + " head " + h2 + " (layer " + (i2 + 1) + ", head " + h2 + ")\nscore " +
          (v2 === null ? "none" : v2.toFixed(4)) + "\nclick to open it in the head view";
      });
      hit.addEventListener("click", function (ev) {
        var c = cellOf(ev);
        self.set({ view: "head", layer: c[0], head: c[1], heads: self.state.heads.map(function (_, q) { return q === c[1]; }) });
      });
      svg.appendChild(g);
    });
    return svg;
  };

  /* ------------------------------------------------------------------ patching view */

  /* Blocks (rows) x the window's positions (columns): the metric after each patch, shaded by
     how far it moves the corrupted run towards the clean one (white: not at all, red: fully). */
  Report.prototype.patchingView = function () {
    var self = this, P = this.data.patching, tokens = this.tokens, bad = P.corrupted_tokens, vals = this.arrays.patch;
    var L = this.L, T = this.T, w = this.win(), lo = w[0], n = w[1] - w[0];
    var span = P.clean_value - P.corrupted_value, mxAbs = 0;
    for (var k = 0; k < vals.length; k++) mxAbs = Math.max(mxAbs, Math.abs(vals[k]));
    // restored share: 0 = the corrupted run, 1 = the clean run; without a span, the raw values
    var level = span !== 0 ? function (v) { return (v - P.corrupted_value) / span; }
      : function (v) { return mxAbs > 0 ? v / mxAbs : 0; };
    var cw = clamp(640 / n, 1, 30), ch = clamp(Math.floor(320 / L), 8, 30);
    var labels = cw >= 9, step = labels ? 1 : Math.ceil(10 / cw), fs = clamp(Math.floor(cw) - 2, 9, 12);
    var longest = 0;
    for (var t = lo; t < lo + n; t++) longest = Math.max(longest, Math.min(16, show(tokens[t]).length + (tokens[t] !== bad[t] ? show(bad[t]).length + 1 : 0)));
    var lab = clamp(longest * fs * 0.62 + (labels ? 10 : 34), 40, 150);
    var left = 70, top = 64 + lab, size = [n * cw, L * ch], barW = 14;
    var lines = ["Activation patching (" + P.hook + "): the residual entering block i at one position, from the clean text into the corrupted one" +
      (n < T ? ", tokens " + lo + "\u2013" + (lo + n - 1) + " of " + T : ""),
      "metric: logit(\u201c" + short(P.clean_token, 20) + "\u201d) \u2212 logit(\u201c" + short(P.corrupted_token, 20) +
      "\u201d) at the last position (the clean run's prediction against the corrupted run's): clean run " + fmt(P.clean_value) +
      ", corrupted run " + fmt(P.corrupted_value),
      "corrupted text: " + short(P.corrupted_text, 140)];
    var W = Math.max(560, left + size[0] + 150, textWidth(lines[0], 12) + 24, textWidth(lines[1], 11) + 24,
      textWidth(lines[2], 11) + 24), Hh = top + size[1] + 24;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, lines[0]));
    svg.appendChild(sv("text", { x: 8, y: 32, "font-size": 11, fill: "#5b6475" }, lines[1]));
    svg.appendChild(sv("text", { "class": "al-corrupted", x: 8, y: 47, "font-size": 11, fill: "#5b6475" }, lines[2]));
    svg.appendChild(sv("image", { x: left, y: top, width: size[0], height: size[1], preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated",
      href: matrixImage(L, n, DIV, function (i, j) { return Math.round((clamp(level(vals[i * T + lo + j]), -1, 1) + 1) / 2 * 255); }) }));
    var ticks = sv("g", { "font-size": fs });
    for (var j = 0; j < n; j += step) {
      var tt = lo + j, diff = tokens[tt] !== bad[tt];
      var name = (labels ? "" : tt + " ") + short(tokens[tt], labels ? 10 : 8) + (diff ? "/" + short(bad[tt], labels ? 10 : 6) : "");
      var cx = left + (j + 0.5) * cw, cy = top - 4;
      ticks.appendChild(sv("text", { x: cx, y: cy, transform: "rotate(-60 " + cx + " " + cy + ")", "dominant-baseline": "central",
        fill: diff ? "#c2410c" : "#1d2330", "font-weight": diff ? 700 : 400 }, name));
    }
    svg.appendChild(ticks);
    var rows = sv("g", { "font-size": 10.5, fill: "#5b6475", "text-anchor": "end" });
    for (var i = 0; i < L; i++) {
      if (ch < 12 && i % Math.ceil(12 / ch)) continue;
      rows.appendChild(sv("text", { x: left - 6, y: top + (i + 0.5) * ch, "dominant-baseline": "central" }, "block " + i));
    }
    svg.appendChild(rows);
    svg.appendChild(sv("rect", { x: left, y: top, width: size[0], height: size[1], fill: "none", stroke: "#c4c9d3" }));
    var bx = left + size[0] + 18, bh = Math.max(60, Math.min(size[1], 200));
    svg.appendChild(sv("image", { x: bx, y: top, width: barW, height: bh, preserveAspectRatio: "none",
      href: matrixImage(64, 1, DIV, function (q) { return Math.round((63 - q) / 63 * 255); }) }));
    svg.appendChild(sv("rect", { x: bx, y: top, width: barW, height: bh, fill: "none", stroke: "#c4c9d3" }));
    var bar = sv("g", { "font-size": 10.5, fill: "#5b6475" });
    var ends = span !== 0 ? ["1: the clean run", "0: the corrupted run", "\u22121"] : [fmt(mxAbs), "0", fmt(-mxAbs)];
    bar.appendChild(sv("text", { x: bx + barW + 4, y: top + 4, "dominant-baseline": "hanging" }, ends[0]));
    bar.appendChild(sv("text", { x: bx + barW + 4, y: top + bh / 2, "dominant-baseline": "central" }, ends[1]));
    bar.appendChild(sv("text", { x: bx + barW + 4, y: top + bh }, ends[2]));
    svg.appendChild(bar);
    var mark = sv("rect", { width: cw, height: ch, fill: "none", stroke: "#1d2330", "stroke-width": 1.5,
      visibility: "hidden", "pointer-events": "none" });
    var hit = sv("rect", { "class": "al-hit", x: left, y: top, width: size[0], height: size[1], fill: "transparent" });
    svg.appendChild(hit);
    svg.appendChild(mark);
    this.hover(hit, L, n, function (i2, j2) {
      var t2 = lo + j2, v = vals[i2 * T + t2];
      var who = "position " + t2 + " \u201c" + short(tokens[t2], 24) + "\u201d" +
        (tokens[t2] !== bad[t2] ? " (corrupted \u201c" + short(bad[t2], 24) + "\u201d)" : "");
      return "block " + i2 + ": the residual entering it (layer " + i2 + "'s output)\n" + who + "\nmetric " + fmt(v) +
        (span !== 0 ? " (" + (100 * level(v)).toFixed(0) + "% of the way to the clean run)" : "");
    }, function (i2, j2) {
      if (i2 < 0) { mark.setAttribute("visibility", "hidden"); return; }
      mark.setAttribute("x", left + j2 * cw); mark.setAttribute("y", top + i2 * ch);
      mark.setAttribute("visibility", "visible");
    });
    return svg;
  };

  /* ------------------------------------------------------------------ attribution views */

  /* The tokens in reading order, each in a box shaded by its score (red +, blue -). */
  Report.prototype.attributionView = function () {
    var A = this.data.attribution, tokens = this.tokens, vals = this.arrays.attr, T = this.T;
    var mx = 0;
    for (var k = 0; k < T; k++) mx = Math.max(mx, Math.abs(vals[k]));
    var lines = ["Input attribution: " + A.method.replace(/_/g, " ") + " (" + A.steps + " points, " + A.baseline +
      " baseline) of log p(\u201c" + short(A.target_token, 24) + "\u201d) at the last position",
      "scores sum to " + fmt(A.value - A.baseline_value - A.gap) + "; log p " + fmt(A.value) + " at the text, " +
      fmt(A.baseline_value) + " at the baseline; completeness gap " + fmt(A.gap)];
    var W = 760, x = 10, y = 56, lineH = 26, boxes = [];
    for (var t = 0; t < T; t++) {
      var label = show(tokens[t]), w = textWidth(label, 13) + 10;
      if (x + w > W - 10 && x > 10) { x = 10; y += lineH; }
      boxes.push([x, y, w, label, t]);
      x += w + 3;
    }
    var Hh = y + lineH + 40;
    W = Math.max(W, textWidth(lines[0], 13) + 24, textWidth(lines[1], 11) + 24);
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, lines[0]));
    svg.appendChild(sv("text", { x: 8, y: 32, "font-size": 11, fill: "#5b6475" }, lines[1]));
    var self = this;
    boxes.forEach(function (b) {
      var v = vals[b[4]], level = mx > 0 ? Math.round((clamp(v / mx, -1, 1) + 1) / 2 * 255) * 3 : 383;
      var fill = "rgb(" + DIV[level] + "," + DIV[level + 1] + "," + DIV[level + 2] + ")";
      var g = sv("g", { "class": "al-attr-token", "data-token": b[4] });
      g.appendChild(sv("rect", { x: b[0], y: b[1] - 16, width: b[2], height: 22, rx: 3, fill: fill, stroke: "#c4c9d3" }));
      g.appendChild(sv("text", { x: b[0] + 5, y: b[1], "font-size": 13, fill: "#1d2330" }, b[3]));
      g.addEventListener("mousemove", function (ev) {
        self.showTip(ev, "token " + b[4] + " \u201c" + short(tokens[b[4]], 24) + "\u201d\nscore " + fmt(v) +
          (mx > 0 ? " (" + (100 * v / mx).toFixed(0) + "% of the largest)" : ""));
      });
      g.addEventListener("mouseleave", function () { self.hideTip(); });
      svg.appendChild(g);
    });
    svg.appendChild(sv("text", { x: 8, y: Hh - 10, "font-size": 11, fill: "#5b6475" },
      "red: towards the prediction, blue: away (scaled to the largest |score|, " + fmt(mx) + ")"));
    return svg;
  };

  /* Activation patching's effect and AtP's estimate of it, side by side, one colour scale. */
  Report.prototype.atpView = function () {
    var self = this, P = this.data.patching, tokens = this.tokens, L = this.L, T = this.T;
    var w = this.win(), lo = w[0], n = w[1] - w[0];
    var effect = new Float32Array(L * T), est = this.arrays.atp, mx = 0;
    for (var k = 0; k < L * T; k++) {
      effect[k] = this.arrays.patch[k] - P.corrupted_value;
      mx = Math.max(mx, Math.abs(effect[k]), Math.abs(est[k]));
    }
    var cw = clamp(300 / n, Math.min(24, 180 / n), 24), ch = clamp(Math.floor(320 / L), 6, 24), left = 64, top = 70;
    var gap = 40, size = [n * cw, L * ch], W = left + 2 * size[0] + gap + 40, Hh = top + size[1] + 70;
    var title = "Activation patching (resid_pre) and attribution patching's estimate of it" +
      (n < T ? ", tokens " + lo + "\u2013" + (lo + n - 1) + " of " + T : "");
    var sub = "each cell: the metric's change from the corrupted run (" + fmt(P.corrupted_value) +
      ") when the residual entering block i at one position is the clean text's";
    W = Math.max(W, textWidth(title, 13) + 24, textWidth(sub, 11) + 24);
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, title));
    svg.appendChild(sv("text", { x: 8, y: 32, "font-size": 11, fill: "#5b6475" }, sub));
    [[effect, "activation patching"], [est, "AtP"]].forEach(function (m, p) {
      var x0 = left + p * (size[0] + gap), vals = m[0];
      svg.appendChild(sv("text", { x: x0, y: top - 22, "font-size": 11, "font-weight": 600, fill: "#1d2330" }, m[1]));
      svg.appendChild(sv("image", { x: x0, y: top, width: size[0], height: size[1], preserveAspectRatio: "none",
        "image-rendering": "pixelated", style: "image-rendering:pixelated",
        href: matrixImage(L, n, DIV, function (i, j) {
          return mx > 0 ? Math.round((clamp(vals[i * T + lo + j] / mx, -1, 1) + 1) / 2 * 255) : 128;
        }) }));
      svg.appendChild(sv("rect", { x: x0, y: top, width: size[0], height: size[1], fill: "none", stroke: "#c4c9d3" }));
      var hit = sv("rect", { "class": "al-hit", x: x0, y: top, width: size[0], height: size[1], fill: "transparent" });
      svg.appendChild(hit);
      self.hover(hit, L, n, function (i2, j2) {
        var t2 = lo + j2;
        return "block " + i2 + ", position " + t2 + " \u201c" + short(tokens[t2], 24) + "\u201d\nactivation patching " +
          fmt(effect[i2 * T + t2]) + "\nAtP " + fmt(est[i2 * T + t2]);
      });
    });
    var rows = sv("g", { "font-size": 10, fill: "#5b6475", "text-anchor": "end" });
    for (var i = 0; i < L; i++) {
      if (ch < 12 && i % Math.ceil(12 / ch)) continue;
      rows.appendChild(sv("text", { x: left - 6, y: top + (i + 0.5) * ch, "dominant-baseline": "central" }, "block " + i));
    }
    svg.appendChild(rows);
    svg.appendChild(sv("text", { x: 8, y: Hh - 12, "font-size": 11, fill: "#5b6475" },
      "columns: positions " + lo + "\u2013" + (lo + n - 1) + "; red: towards the clean run, blue: away; scale \u00b1" + fmt(mx)));
    return svg;
  };

  /* The circuit: nodes by block (columns), heads by index (rows), MLPs below; edges as curves. */
  Report.prototype.circuitView = function () {
    var self = this, C = this.data.attribution.circuit, H = this.H;
    var nodes = {}, blocks = [], maxAbs = 0;
    function node(name) {
      var m = /^a(\d+)\.(h|kv)(\d+)/.exec(name), mm = /^m(\d+)/.exec(name);
      if (name === "input") return { key: "input", col: -1, row: 0 };
      if (name === "logits") return { key: "logits", col: Infinity, row: 0 };
      if (mm) return { key: "m" + mm[1], col: Number(mm[1]), row: H + 1 };
      return { key: "a" + m[1] + "." + m[2] + m[3], col: Number(m[1]), row: m[2] === "h" ? Number(m[3]) : H + 2 + Number(m[3]) };
    }
    C.edges.forEach(function (e) {
      [node(e[0]), node(e[1].split("<")[0])].forEach(function (nd) {
        nodes[nd.key] = nd;
        if (isFinite(nd.col) && nd.col >= 0 && blocks.indexOf(nd.col) < 0) blocks.push(nd.col);
      });
      if (e[2] !== null) maxAbs = Math.max(maxAbs, Math.abs(e[2]));
    });
    blocks.sort(function (a, b) { return a - b; });
    var colW = 64, rowH = 26, left = 70, top = 66, maxRow = 0;
    for (var k in nodes) maxRow = Math.max(maxRow, nodes[k].row);
    var W = left + (blocks.length + 1) * colW + 90, Hh = top + (maxRow + 1) * rowH + 60;
    function pos(nd) {
      var x = nd.col === -1 ? left - 30 : !isFinite(nd.col) ? left + (blocks.length + 0.6) * colW
        : left + (blocks.indexOf(nd.col) + 0.5) * colW;
      var y = nd.col === -1 || !isFinite(nd.col) ? top + (maxRow / 2) * rowH : top + nd.row * rowH;
      return [x, y];
    }
    var title = "Circuit found by EAP-IG (" + C.steps + " points): " + C.edges.length + " edges of " + C.edges_scored +
      "; faithfulness " + (C.faithfulness === null ? "undefined" : (100 * C.faithfulness).toFixed(0) + "%");
    var sub = "faithfulness: the share of the metric recovered when every other edge is patched to its corrupted " +
      "value (metric " + (C.circuit_value === null ? "?" : fmt(C.circuit_value)) + ")";
    var foot = "a<block>.h<head>: an attention head (a<block>.kv<g>: a key/value head); m<block>: an MLP; " +
      "edges into a head by its q, k or v input";
    W = Math.max(W, textWidth(title, 13) + 24, textWidth(sub, 11) + 24, textWidth(foot, 11) + 24);
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, title));
    svg.appendChild(sv("text", { x: 8, y: 32, "font-size": 11, fill: "#5b6475" }, sub));
    blocks.forEach(function (b, i) {
      svg.appendChild(sv("text", { x: left + (i + 0.5) * colW, y: top - 18, "text-anchor": "middle", "font-size": 10,
        fill: "#5b6475" }, "block " + b));
    });
    var edges = sv("g", { fill: "none" });
    C.edges.slice().reverse().forEach(function (e) {
      var a = pos(nodes[node(e[0]).key]), b = pos(nodes[node(e[1].split("<")[0]).key]);
      var part = (/<(q|k|v)>/.exec(e[1]) || [])[1], v = e[2] === null ? 0 : e[2];
      var mid = (a[0] + b[0]) / 2;
      var path = sv("path", { "class": "al-edge", d: "M" + a[0] + "," + a[1] + " C" + mid + "," + a[1] + " " + mid + "," + b[1] +
        " " + b[0] + "," + b[1], stroke: v >= 0 ? "#b2182b" : "#2166ac", "stroke-opacity": 0.75,
        "stroke-width": maxAbs > 0 ? 0.8 + 4.2 * Math.abs(v) / maxAbs : 1,
        "stroke-dasharray": part === "k" ? "5,3" : part === "v" ? "1.5,2.5" : "none" });
      path.addEventListener("mousemove", function (ev) { self.showTip(ev, e[0] + " \u2192 " + e[1] + "\nscore " + fmt(v)); });
      path.addEventListener("mouseleave", function () { self.hideTip(); });
      edges.appendChild(path);
    });
    svg.appendChild(edges);
    for (k in nodes) {
      var nd = nodes[k], p = pos(nd), head = /\.h(\d+)$/.exec(k);
      var g = sv("g", { "class": "al-node", "data-node": k });
      g.appendChild(sv("circle", { cx: p[0], cy: p[1], r: 9, fill: head ? headColor(Number(head[1])) : "#5b6475",
        stroke: "#fff", "stroke-width": 1.5 }));
      g.appendChild(sv("text", { x: p[0] + 11, y: p[1] + 4, "font-size": 10, fill: "#1d2330" }, k));
      svg.appendChild(g);
    }
    svg.appendChild(sv("text", { x: 8, y: Hh - 12, "font-size": 11, fill: "#5b6475" }, foot));
    return svg;
  };

  /* ------------------------------------------------------------------ rollout view */

  /* The rollout through layers 1..l + 1 as a tokens x tokens heatmap of the window. */
  Report.prototype.rolloutView = function () {
    var self = this, tokens = this.tokens, l = this.state.layer, T = this.T;
    var codes = this.arrays.roll, rmax = this.arrays.roll_max;
    var w = this.win(), lo = w[0], n = w[1] - w[0];
    var val = function (i, j) { var r = l * T + lo + i; return codes[r * T + lo + j] * rmax[r] / 255; };
    var cell = clamp(640 / n, 1, 30), size = cell * n, labels = cell >= 9, step = labels ? 1 : Math.ceil(10 / cell);
    var fs = clamp(Math.floor(cell) - 2, 9, 12), longest = 0;
    for (var t = lo; t < lo + n; t++) longest = Math.max(longest, Math.min(14, show(tokens[t]).length));
    var lab = clamp(longest * fs * 0.62 + (labels ? 10 : 34), 40, 140);
    var left = lab + 8, top = lab + 30;
    var title = "Attention rollout through layers 1\u2013" + (l + 1) + " (rows: tokens after layer " + (l + 1) +
      ", columns: input tokens)" + (n < T ? ", tokens " + lo + "\u2013" + (lo + n - 1) + " of " + T : "");
    var W = Math.max(380, left + size + 80, textWidth(title, 12) + 20), Hh = top + size + 16;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    svg.appendChild(sv("text", { x: 8, y: 16, "font-size": 12, "font-weight": 600, fill: "#1d2330" }, title));
    var mx = 0;
    for (var i = 0; i < n; i++) for (var j = 0; j < n; j++) mx = Math.max(mx, val(i, j));
    var inv = mx > 0 ? 255 / mx : 0;
    svg.appendChild(sv("image", { x: left, y: top, width: size, height: size, preserveAspectRatio: "none",
      "image-rendering": "pixelated", style: "image-rendering:pixelated",
      href: matrixImage(n, n, SEQ, function (a, b) { return Math.round(val(a, b) * inv); }) }));
    var ticks = sv("g", { "font-size": fs, fill: "#1d2330" });
    for (i = 0; i < n; i += step) {
      var name = labels ? short(tokens[lo + i], 14) : (lo + i) + " " + short(tokens[lo + i], 8);
      ticks.appendChild(sv("text", { x: left - 4, y: top + (i + 0.5) * cell, "text-anchor": "end", "dominant-baseline": "central" }, name));
      var cx = left + (i + 0.5) * cell, cy = top - 4;
      ticks.appendChild(sv("text", { x: cx, y: cy, transform: "rotate(-60 " + cx + " " + cy + ")", "dominant-baseline": "central" }, name));
    }
    svg.appendChild(ticks);
    svg.appendChild(sv("rect", { x: left, y: top, width: size, height: size, fill: "none", stroke: "#c4c9d3" }));
    var hit = sv("rect", { "class": "al-hit", x: left, y: top, width: size, height: size, fill: "transparent" });
    svg.appendChild(hit);
    this.hover(hit, n, n, function (i2, j2) {
      return "token " + (lo + i2) + " \u201c" + short(tokens[lo + i2], 30) + "\u201d after layer " + (l + 1) + " draws on input token " +
        (lo + j2) + " \u201c" + short(tokens[lo + j2], 30) + "\u201d\nrollout " + val(i2, j2).toFixed(4);
    });
    return svg;
  };

  /* ------------------------------------------------------------------ embedding view */

  /* Where a label may sit around its point (y grows downwards): the corners, then above,
     below, right and left, at growing distances; the first place that overlaps no placed
     label, no marker and stays inside `bounds` wins, else the one with the least overlap
     (attnlab.viz.plots.spread_labels does the same for the PNG). */
  var DIRS = [[1, -1], [1, 1], [-1, -1], [-1, 1], [0, -1], [0, 1], [1, 0], [-1, 0]];
  var RINGS = [1, 2, 3, 5, 8, 12, 18];
  function overlapArea(boxes, x0, y0, x1, y1) {
    var a = 0;
    for (var k = 0; k < boxes.length; k++) {
      var b = boxes[k];
      var dx = Math.min(b[2], x1) - Math.max(b[0], x0), dy = Math.min(b[3], y1) - Math.max(b[1], y0);
      if (dx > 0 && dy > 0) a += dx * dy;
    }
    return a;
  }
  function spreadLabels(items, obstacles, bounds, gap) {
    var placed = obstacles.slice();
    return items.map(function (it) {
      var best = null, bestCost = Infinity;
      for (var r = 0; r < RINGS.length && bestCost > 0; r++) {
        var d = gap * RINGS[r];
        for (var k = 0; k < DIRS.length; k++) {
          var ux = DIRS[k][0], uy = DIRS[k][1];
          var x0 = ux > 0 ? it.x + d : ux < 0 ? it.x - d - it.w : it.x - it.w / 2;
          var y0 = uy > 0 ? it.y + d : uy < 0 ? it.y - d - it.h : it.y - it.h / 2;
          var cost = overlapArea(placed, x0, y0, x0 + it.w, y0 + it.h);
          var inside = Math.max(0, Math.min(x0 + it.w, bounds[2]) - Math.max(x0, bounds[0])) *
            Math.max(0, Math.min(y0 + it.h, bounds[3]) - Math.max(y0, bounds[1]));
          cost += it.w * it.h - inside;
          if (cost < 1e-6 * it.w * it.h) cost = 0;
          if (cost < bestCost) { best = [x0, y0, RINGS[r]]; bestCost = cost; }
          if (cost === 0) break;
        }
      }
      placed.push([best[0], best[1], best[0] + it.w, best[1] + it.h]);
      return best;
    });
  }

  /* Points that coincide (equal words without positions) share one label: "the \u00d72". */
  function groupLabels(idx, pts, tokens) {
    var groups = [], byKey = {};
    idx.forEach(function (i, k) {
      var key = pts[k][0] + "," + pts[k][1];
      if (!(key in byKey)) { byKey[key] = groups.length; groups.push({ k: k, names: [] }); }
      groups[byKey[key]].names.push(short(tokens[i], 16));
    });
    return groups.map(function (g) {
      var counts = {}, order = [];
      g.names.forEach(function (n) { if (!(n in counts)) { counts[n] = 0; order.push(n); } counts[n]++; });
      return { k: g.k, text: order.map(function (n) { return counts[n] > 1 ? n + " \u00d7" + counts[n] : n; }).join(", ") };
    });
  }

  function extent(pts) {
    var xs = pts.map(function (q) { return q[0]; }), ys = pts.map(function (q) { return q[1]; });
    return [Math.min.apply(null, xs), Math.min.apply(null, ys), Math.max.apply(null, xs), Math.max.apply(null, ys)];
  }

  Report.prototype.embeddingView = function () {
    var e = this.data.embedding, tokens = this.tokens, self = this;
    var w = this.win(), lo = w[0], hi = w[1], n = hi - lo, idx = range(n).map(function (k) { return lo + k; });
    var S = idx.map(function (i) { return e.static[i]; }), C = idx.map(function (i) { return e.contextual[i]; });
    var joint = e.joint;
    // Attention averages the value vectors, so the contextual points often huddle together:
    // then a second panel shows them magnified (same projection).
    var all = extent(S.concat(C)), ce = extent(C);
    var span = Math.max(all[2] - all[0], all[3] - all[1]), cspan = Math.max(ce[2] - ce[0], ce[3] - ce[1]);
    var zoom = joint && n > 1 && span > 0 && cspan < 0.25 * span;
    var ph = 500, gap = 30, top = 56;
    var panels;
    if (joint && zoom) {
      panels = [{ s: S, c: C, ox: 20, pw: 560, arrows: true, labels: [true, false] },
        { s: null, c: C, ox: 20 + 560 + gap, pw: 400, arrows: false, labels: [false, true], magnified: true }];
    } else if (joint) {
      panels = [{ s: S, c: C, ox: 20, pw: 760, arrows: true, labels: [true, true] }];
    } else {
      panels = [{ s: S, c: null, ox: 20, pw: 520, arrows: false, labels: [true, false] },
        { s: null, c: C, ox: 20 + 520 + gap, pw: 520, arrows: false, labels: [false, true] }];
    }
    var last = panels[panels.length - 1];
    var W = last.ox + last.pw + 30, Hh = ph + top + 20;
    var svg = sv("svg", { width: W, height: Hh, viewBox: "0 0 " + W + " " + Hh, "font-family": FONT });
    var pct = function (x) { return (100 * x).toFixed(0) + "%"; };
    svg.appendChild(sv("text", { x: 20, y: 18, "font-size": 12, "font-weight": 600, fill: "#1d2330" },
      (joint ? "Static \u2192 contextual token vectors (PCA fitted on the static vectors: PC1 " + pct(e.explained[0]) +
        ", PC2 " + pct(e.explained[1]) + " of the variance)"
        : "Static and contextual vectors have different widths: each set has its own PCA") +
      (n < this.T ? ", tokens " + lo + "\u2013" + (hi - 1) + " of " + this.T : "")));
    var legend = sv("g", { "font-size": 11, fill: "#5b6475" });
    legend.appendChild(sv("circle", { cx: 26, cy: 36, r: 4.5, fill: "#fff", stroke: "#6b6b6b", "stroke-width": 1.5 }));
    legend.appendChild(sv("text", { x: 36, y: 36, "dominant-baseline": "central" }, "static (before attention)"));
    legend.appendChild(sv("circle", { cx: 206, cy: 36, r: 4.5, fill: "#2f5dd0" }));
    legend.appendChild(sv("text", { x: 216, y: 36, "dominant-baseline": "central" }, "contextual (after the last layer)"));
    svg.appendChild(legend);
    var hl = [], rDot = n > 120 ? 3.5 : 4.5;
    panels.forEach(function (p) {
      var ext = extent((p.s || []).concat(p.c || []));
      var dx = (ext[2] - ext[0]) || 1, dy = (ext[3] - ext[1]) || 1;
      if (p.magnified) {  // square, like the dashed box drawn on the main panel
        var mid = [(ext[0] + ext[2]) / 2, (ext[1] + ext[3]) / 2], half = 0.6 * Math.max(dx, dy);
        ext = [mid[0] - half, mid[1] - half, mid[0] + half, mid[1] + half]; dx = dy = 2 * half;
        p.box = ext;
      }
      var ox = p.ox, pw = p.pw, m = 30;
      var X = function (v) { return ox + m + (v - ext[0]) / dx * (pw - 2 * m); };
      var Y = function (v) { return top + ph - m - (v - ext[1]) / dy * (ph - 2 * m); };
      p.X = X; p.Y = Y;
      var g = sv("g", { "class": p.magnified ? "al-emb-zoom" : "al-emb-main" });
      g.appendChild(sv("rect", { x: ox, y: top, width: pw, height: ph, fill: "#fff", stroke: p.magnified ? "#5b6475" : "#d8dce4",
        "stroke-dasharray": p.magnified ? "5 3" : "none" }));
      g.appendChild(sv("text", { x: ox + pw / 2, y: top + ph + 14, "text-anchor": "middle", "font-size": 11, fill: "#5b6475" },
        p.magnified ? "contextual points, magnified (dashed box on the left)" : "PC1"));
      if (!p.magnified) {
        g.appendChild(sv("text", { x: ox - 6, y: top + ph / 2, "text-anchor": "middle", "font-size": 11, fill: "#5b6475",
          transform: "rotate(-90 " + (ox - 6) + " " + (top + ph / 2) + ")" }, "PC2"));
      }
      if (p.arrows) {
        var arrows = sv("g", { "class": "al-arrows", stroke: "#9aa3b5", "stroke-width": 1, "stroke-opacity": 0.9 });
        var heads = sv("g", { "class": "al-arrowheads", fill: "#7d8699" });
        for (var k = 0; k < n; k++) {
          var x1 = X(p.s[k][0]), y1 = Y(p.s[k][1]), x2 = X(p.c[k][0]), y2 = Y(p.c[k][1]);
          var len = Math.hypot(x2 - x1, y2 - y1);
          if (len < 2 * rDot + 4) continue;  // the points touch: no room for an arrow
          var ux = (x2 - x1) / len, uy = (y2 - y1) / len;
          var tx = x2 - ux * (rDot + 1), ty = y2 - uy * (rDot + 1), bx = tx - ux * 8, by = ty - uy * 8;
          arrows.appendChild(sv("line", { x1: (x1 + ux * rDot).toFixed(1), y1: (y1 + uy * rDot).toFixed(1),
            x2: bx.toFixed(1), y2: by.toFixed(1) }));
          heads.appendChild(sv("polygon", { "class": "al-arrowhead", "data-idx": String(lo + k), points:
            tx.toFixed(1) + "," + ty.toFixed(1) + " " + (bx - uy * 3.5).toFixed(1) + "," + (by + ux * 3.5).toFixed(1) + " " +
            (bx + uy * 3.5).toFixed(1) + "," + (by - ux * 3.5).toFixed(1) }));
        }
        g.appendChild(arrows);
        g.appendChild(heads);
      }
      var dots = sv("g"), markers = [];
      [p.s, p.c].forEach(function (set, kind) {
        if (!set) return;
        for (var k = 0; k < n; k++) {
          var cx = X(set[k][0]), cy = Y(set[k][1]);
          var c = sv("circle", { cx: cx.toFixed(1), cy: cy.toFixed(1), r: rDot,
            "data-idx": String(lo + k), "data-kind": String(kind), "class": "al-dot" });
          if (kind === 0) { c.setAttribute("fill", "#fff"); c.setAttribute("stroke", "#6b6b6b"); c.setAttribute("stroke-width", 1.5); }
          else { c.setAttribute("fill", "#2f5dd0"); c.setAttribute("fill-opacity", 0.85); }
          dots.appendChild(c);
          hl.push(c);
          markers.push([cx - rDot - 1, cy - rDot - 1, cx + rDot + 1, cy + rDot + 1]);
        }
      });
      g.appendChild(dots);
      if (n <= 60) {
        var items = [], fs = p.magnified ? 10.5 : 11;
        [p.s, p.c].forEach(function (set, kind) {
          if (!set || !p.labels[kind]) return;
          groupLabels(idx, set, tokens).forEach(function (gl) {
            items.push({ x: X(set[gl.k][0]), y: Y(set[gl.k][1]), w: textWidth(gl.text, fs) + 2, h: fs + 3,
              text: gl.text, kind: kind });
          });
        });
        var boxes = spreadLabels(items, markers, [ox + 2, top + 2, ox + pw - 2, top + ph - 2], 3);
        var lab = sv("g", { "class": "al-labels", "font-size": fs, "pointer-events": "none" });
        items.forEach(function (it, k) {
          var b = boxes[k], color = it.kind === 0 ? "#5b6475" : "#2f5dd0";
          if (b[2] > 2) {  // moved away from its point: a leader line shows whose it is
            var ex = clamp(it.x, b[0], b[0] + it.w), ey = clamp(it.y, b[1], b[1] + it.h);
            lab.appendChild(sv("line", { x1: it.x.toFixed(1), y1: it.y.toFixed(1), x2: ex.toFixed(1), y2: ey.toFixed(1),
              stroke: color, "stroke-width": 0.6, "stroke-opacity": 0.7 }));
          }
          lab.appendChild(sv("text", { "class": "al-point-label", "data-kind": String(it.kind), x: (b[0] + 1).toFixed(1),
            y: (b[1] + it.h / 2).toFixed(1), "dominant-baseline": "central", fill: color }, it.text));
        });
        g.appendChild(lab);
      }
      svg.appendChild(g);
    });
    if (zoom) {  // mark the magnified region on the main panel
      var b = panels[1].box, P = panels[0];
      var bx0 = P.X(b[0]), bx1 = P.X(b[2]), by0 = P.Y(b[3]), by1 = P.Y(b[1]);
      svg.appendChild(sv("rect", { "class": "al-zoom-box", x: bx0.toFixed(1), y: by0.toFixed(1),
        width: Math.max(2, bx1 - bx0).toFixed(1), height: Math.max(2, by1 - by0).toFixed(1),
        fill: "none", stroke: "#5b6475", "stroke-dasharray": "5 3", "pointer-events": "none" }));
    }
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
    if (s.view === "head" || s.view === "heatmap" || s.view === "rollout") name += "-layer" + (s.layer + 1);
    if (s.view === "heatmap") name += "-head" + s.head;
    if (s.view === "steps") name += "-head" + s.stepHead;
    if (this.span() < this.T && s.view !== "steps" && s.view !== "detectors") {
      var w = this.win(); name += "-tokens" + w[0] + "-" + (w[1] - 1);
    }
    return name + "." + ext;
  };

  Report.prototype.svgText = function () {
    var svg = this.stage.querySelector("svg").cloneNode(true);
    svg.setAttribute("xmlns", NS);
    svg.setAttribute("font-family", FONT);
    svg.insertBefore(sv("rect", { x: 0, y: 0, width: "100%", height: "100%", fill: "#ffffff" }), svg.firstChild);
    var hits = svg.querySelectorAll(".al-hit");
    for (var k = 0; k < hits.length; k++) hits[k].parentNode.removeChild(hits[k]);
    // Whatever the tokens hold, the file must be well-formed XML.
    var walk = document.createTreeWalker(svg, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT), node = svg;
    while (node) {
      if (node.nodeType === 3) node.nodeValue = xmlSafe(node.nodeValue);
      else for (var a = 0; a < node.attributes.length; a++) node.attributes[a].value = xmlSafe(node.attributes[a].value);
      node = walk.nextNode();
    }
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

  function startAll() {
    var roots = document.querySelectorAll(".attnlab-report");
    for (var r = 0; r < roots.length; r++) {
      if (roots[r].getAttribute("data-started")) continue;
      roots[r].setAttribute("data-started", "1");
      start(roots[r]);
    }
  }
  if (!window.attnlabReport) window.attnlabReport = { start: startAll };
  startAll();
})();
