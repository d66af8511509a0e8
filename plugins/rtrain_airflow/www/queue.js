/* The Training queue page (plugins/rtrain_airflow/webapp.py serves it): a Cancel button per run not ended.
 *
 * Cancel asks as `rtrain cancel` does (POST .../queue/{run}/cancel, edit access to the DAG runs, with the
 * session's cookie like the Training view's Stop): a queued run ends cancelled (never started), a running
 * one stopped (its job commits the step it is on; resumable by a new submit).  The page reloads every 5 s,
 * not while a cancel is being asked.  No inline script (the page's Content-Security-Policy forbids it).
 */
(function () {
  "use strict";

  const body = document.body;
  const API = body.dataset.api;
  const QUERY = body.dataset.query || "";
  const said = document.getElementById("said");
  let busy = false;

  function say(text) {
    said.textContent = text;
    said.hidden = false;
  }

  async function cancel(button) {
    const run = button.dataset.run;
    const running = button.closest("tr").dataset.state !== "queued";
    const what = running
      ? "Cancel " + run + "? Its job stops at the step it is on, which is committed; the run ends stopped (not failed) and a new submit resumes it."
      : "Cancel " + run + "? It leaves the queue without starting and ends cancelled.";
    if (!window.confirm(what)) return;
    busy = true;
    button.disabled = true;
    try {
      const r = await fetch(API + "/" + encodeURIComponent(run) + "/cancel" + QUERY, {
        method: "POST", credentials: "same-origin", headers: { Accept: "application/json" },
      });
      let payload = null;
      try { payload = await r.json(); } catch (e) { payload = null; }
      if (!r.ok) throw new Error((payload && payload.detail) || r.statusText || ("HTTP " + r.status));
      say("Asked to cancel " + run + ": it ends " + (running ? "stopped" : "cancelled") + " at the scheduler's next look.");
    } catch (err) {
      say("Could not cancel " + run + ": " + err.message);
      button.disabled = false;
    }
    busy = false;
  }

  for (const button of document.querySelectorAll("button.cancel")) {
    button.addEventListener("click", () => cancel(button));
  }

  function reload() {
    if (busy || document.hidden) window.setTimeout(reload, 1000);
    else window.location.reload();
  }
  window.setTimeout(reload, 5000);
})();
