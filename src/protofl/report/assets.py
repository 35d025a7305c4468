"""The report page's style sheet and script (written here, no library): method toggles and
hover values on the curves. ``#selftest`` in the address makes the script exercise both
and record the outcome on ``<body data-selftest>``, for headless tests."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;
  max-width:1280px;padding:0 24px 48px;color:#1b1b1b}
h1{margin:24px 0 4px}h2{border-bottom:2px solid #ddd;margin-top:40px}
h3{margin-top:28px}h4{margin:22px 0 6px;color:#333}
.muted,.caption{color:#555}.caption{max-width:1100px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}
.scroll{overflow-x:auto}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right;white-space:nowrap}
th:first-child,td:first-child{text-align:left}thead th{background:#f4f4f4}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px}
.toggles{margin:8px 0;display:flex;flex-wrap:wrap;gap:4px 14px}
.toggles label{cursor:pointer;user-select:none}
.grid{display:flex;flex-wrap:wrap;gap:10px}
figure{margin:0}figure svg{max-width:100%;height:auto}
figure.curve svg{width:400px}figure.cm svg{width:100%}
figure.wide svg{width:auto;max-width:100%}
img.png{max-width:100%}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #999;
  border-radius:4px;padding:4px 8px;font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.2);
  z-index:10}
#errors{color:#b00;background:#fee;padding:8px}
details{margin:4px 0}pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px}
.note{font-style:italic;color:#666}
"""

ERRORS = """
window.addEventListener("error", function (e) {
  var el = document.getElementById("errors");
  if (el) { el.hidden = false; el.textContent += "script error: " + e.message + "\\n"; }
});
"""

SCRIPT = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var tip = document.getElementById("tip");

  function hidden(block, i) { return block.classList.contains("hide-" + i); }

  document.querySelectorAll("input.toggle").forEach(function (box) {
    box.addEventListener("change", function () {
      var block = box.closest(".block"), i = box.getAttribute("data-series");
      block.classList.toggle("hide-" + i, !box.checked);
      block.querySelectorAll(".series-" + i).forEach(function (el) {
        el.style.display = box.checked ? "" : "none";
      });
    });
  });

  function fmt(v) {
    var a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(3) : v.toFixed(4);
  }

  function hide(guide) { tip.hidden = true; guide.style.display = "none"; }

  function show(fig, meta, guide, ev) {
    var svg = fig.querySelector("svg"), pt = svg.createSVGPoint();
    pt.x = ev.clientX; pt.y = ev.clientY;
    var p = pt.matrixTransform(svg.getScreenCTM().inverse()), b = meta.box;
    if (p.x < b[0] || p.x > b[2] || p.y < b[1] || p.y > b[3]) { hide(guide); return; }
    var xv = meta.xlim[0] + (p.x - b[0]) / (b[2] - b[0]) * (meta.xlim[1] - meta.xlim[0]);
    var block = fig.closest(".block"), best = null;
    meta.series.forEach(function (s) {
      if (hidden(block, s.i)) { return; }
      s.x.forEach(function (x) {
        if (best === null || Math.abs(x - xv) < Math.abs(best - xv)) { best = x; }
      });
    });
    if (best === null) { hide(guide); return; }
    tip.textContent = "";
    var head = document.createElement("div");
    head.textContent = meta.title + ", round " + best;
    head.style.fontWeight = "bold";
    tip.appendChild(head);
    meta.series.forEach(function (s) {
      var k = s.x.indexOf(best);
      if (k < 0 || hidden(block, s.i)) { return; }
      var row = document.createElement("div"), sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = fig.getAttribute("data-color-" + s.i);
      row.appendChild(sw);
      row.appendChild(document.createTextNode(
        s.name + ": " + fmt(s.y[k]) + (s.s[k] ? " ± " + fmt(s.s[k]) : "")));
      tip.appendChild(row);
    });
    var gx = b[0] + (best - meta.xlim[0]) / (meta.xlim[1] - meta.xlim[0]) * (b[2] - b[0]);
    guide.setAttribute("x1", gx); guide.setAttribute("x2", gx);
    guide.style.display = "";
    tip.hidden = false;
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 4) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  }

  document.querySelectorAll("figure.curve").forEach(function (fig) {
    var meta = JSON.parse(fig.getAttribute("data-meta")), svg = fig.querySelector("svg");
    var guide = document.createElementNS(NS, "line");
    guide.setAttribute("y1", meta.box[1]); guide.setAttribute("y2", meta.box[3]);
    guide.setAttribute("stroke", "#444"); guide.setAttribute("stroke-dasharray", "3,3");
    guide.style.display = "none";
    svg.appendChild(guide);
    svg.addEventListener("mousemove", function (ev) { show(fig, meta, guide, ev); });
    svg.addEventListener("mouseleave", function () { hide(guide); });
  });

  if (location.hash === "#selftest") {
    var out = {}, fig = document.querySelector("figure.curve");
    if (fig) {
      var meta = JSON.parse(fig.getAttribute("data-meta")), svg = fig.querySelector("svg");
      var m = svg.getScreenCTM(), b = meta.box;
      var x = (b[0] + b[2]) / 2, y = (b[1] + b[3]) / 2;
      svg.dispatchEvent(new MouseEvent("mousemove", {bubbles: true,
        clientX: m.a * x + m.c * y + m.e, clientY: m.b * x + m.d * y + m.f}));
      out.tip = tip.hidden ? "" : tip.textContent;
      var box = fig.closest(".block").querySelector("input.toggle");
      box.checked = false;
      box.dispatchEvent(new Event("change"));
      var el = fig.querySelector(".series-" + box.getAttribute("data-series"));
      out.hiddenAfterToggle = el !== null && el.style.display === "none";
    }
    document.body.setAttribute("data-selftest", JSON.stringify(out));
  }
  document.body.setAttribute("data-ready", "yes");
})();
"""
