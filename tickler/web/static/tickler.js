// tickler's dashboard: reload the page every data-refresh seconds, unless paused.
// The pause is kept in this browser's sessionStorage, so it holds across pages.
"use strict";
(function () {
  // An action's notice shows once: a reload of its page does not repeat it.
  var here = new URL(location.href);
  if (here.searchParams.has("done")) {
    here.searchParams.delete("done");
    here.searchParams.delete("n");
    history.replaceState(null, "", here.pathname + here.search);
  }
  var seconds = Number(document.body.dataset.refresh || 0);
  var toggle = document.getElementById("refresh-toggle");
  var state = document.getElementById("refresh-state");
  if (!seconds || !toggle) { return; }
  var timer = null;
  function paused() { return sessionStorage.getItem("tickler-refresh") === "paused"; }
  function show() {
    toggle.textContent = paused() ? "Resume refresh" : "Pause refresh";
    state.textContent = paused() ? "refresh paused" : "refreshes every " + seconds + " s";
  }
  function arm() {
    clearTimeout(timer);
    if (!paused()) { timer = setTimeout(function () { location.reload(); }, seconds * 1000); }
  }
  toggle.addEventListener("click", function () {
    sessionStorage.setItem("tickler-refresh", paused() ? "running" : "paused");
    show();
    arm();
  });
  toggle.hidden = false;
  show();
  arm();
})();
