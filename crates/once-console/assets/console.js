// once-ledger console: makes the UNKNOWN queue live. The page works without it; with it, the
// queue's table is fetched again whenever the ledger says an operation entered or left
// UNKNOWN (server-sent events from WatchOperations; the browser resumes after the last event
// id when the stream breaks).
(function () {
  "use strict";
  var section = document.querySelector("section[data-live]");
  if (!section || !window.EventSource) { return; }
  var status = document.createElement("p");
  status.className = "live";
  status.setAttribute("role", "status");
  status.textContent = "Connecting for live updates…";
  section.parentNode.insertBefore(status, section);
  var pending = null;
  function refresh() {
    pending = null;
    // Marked as the page's own request: it does not keep an unattended session alive.
    fetch(section.getAttribute("data-rows"), {
      credentials: "same-origin",
      headers: { "Accept": "text/html", "X-Console-Live": "1" }
    })
      .then(function (response) {
        if (response.redirected || !response.ok) { source.close(); window.location.reload(); return null; }
        return response.text();
      })
      .then(function (html) { if (html !== null) { section.innerHTML = html; } })
      .catch(function () { status.textContent = "Live updates interrupted; retrying…"; });
  }
  var source = new EventSource(section.getAttribute("data-live"));
  var opens = 0;
  source.addEventListener("open", function () {
    opens += 1;
    status.setAttribute("data-opens", String(opens));
    status.textContent = "Live: this page updates as operations enter and leave UNKNOWN.";
    refresh();
  });
  source.addEventListener("change", function () {
    if (pending === null) { pending = window.setTimeout(refresh, 150); }
  });
  source.addEventListener("error", function () {
    status.textContent = "Live updates interrupted; reconnecting…";
  });
})();
