// interlock console: live updates over Server-Sent Events, no build step, no dependency.
// The page works without it (every action is a plain form); with it, the part of the page
// marked data-live is fetched again when the journal changes, unless the operator is
// typing into a form there: then a note offers the refresh instead of wiping the form.
(function () {
  "use strict";
  var live = document.querySelector("[data-live]");
  if (!live || !window.EventSource) { return; }
  var note = document.getElementById("live-note");
  var status = document.getElementById("live-status");
  var dirty = false;
  var pending = false;
  var busy = false;
  live.addEventListener("input", function () { dirty = true; });
  function editing() {
    var active = document.activeElement;
    return dirty || (active && live.contains(active) && /INPUT|TEXTAREA|SELECT/.test(active.tagName));
  }
  function refresh() {
    if (busy) { pending = true; return; }
    if (editing()) { if (note) { note.hidden = false; } return; }
    busy = true;
    fetch(window.location.href, { headers: { "Accept": "text/html" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (text) {
        if (text === null) { return; }
        var doc = new DOMParser().parseFromString(text, "text/html");
        var fresh = doc.querySelector("[data-live]");
        if (fresh && !editing()) { live.innerHTML = fresh.innerHTML; }
        if (status) { status.textContent = "Updated " + new Date().toLocaleTimeString(); }
      })
      .catch(function () {})
      .then(function () { busy = false; if (pending) { pending = false; setTimeout(refresh, 300); } });
  }
  if (note) {
    var button = note.querySelector("button");
    if (button) { button.addEventListener("click", function () { dirty = false; note.hidden = true; window.location.reload(); }); }
  }
  var source = new EventSource(live.getAttribute("data-live"));
  source.addEventListener("journal", refresh);
  source.addEventListener("changed", refresh);
  source.addEventListener("end", function () { source.close(); refresh(); });
  source.onerror = function () { if (status) { status.textContent = "Live updates paused; retrying"; } };
  source.onopen = function () { if (status) { status.textContent = "Live"; } };
})();
