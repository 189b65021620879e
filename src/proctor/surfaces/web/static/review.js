// proctor review: live rows from /review/events (server-sent events). Text only: no HTML from the stream
// is ever parsed (textContent, never innerHTML), so nothing a job printed can become markup here; the server
// has already passed every string through the one escaping function (bidi and control characters marked).
"use strict";
(function () {
  const prefix = document.body.dataset.root;  // the page's secret path: the session cookie is scoped to it
  const page = document.body.dataset.page;

  document.querySelectorAll("form[data-confirm]").forEach(function (form) {
    form.addEventListener("submit", function (ev) {
      if (!window.confirm(form.dataset.confirm)) ev.preventDefault();
    });
  });

  if (!window.EventSource || !page || !prefix) return;
  // The same filters as the page (the list's query), or only this job.
  const query = page === "job" ? "?job=" + encodeURIComponent(document.body.dataset.job) : window.location.search;
  const source = new EventSource(prefix + "/events" + query);
  const note = document.getElementById("live-note");
  source.addEventListener("open", function () { if (note) note.classList.add("on"); });
  source.addEventListener("error", function () { if (note) note.classList.remove("on"); });

  function setBadge(el, text, cls) {
    if (!el) return;
    el.textContent = text;
    el.className = "badge " + cls;
  }

  function updateRow(tr, r) {
    tr.className = "row-" + r.badge;
    setBadge(tr.querySelector('[data-field="status"]'), r.status, r.badge);
    setBadge(tr.querySelector('[data-field="review"]'), r.review, r.reviewBadge);
    const code = tr.querySelector('[data-field="code"]');
    if (code) code.textContent = r.code;
    const age = tr.querySelector('[data-field="age"]');
    if (age) age.textContent = r.age;
    const risks = tr.querySelector('[data-field="risks"]');
    if (risks) {
      risks.textContent = "";
      if (r.risks) {
        const b = document.createElement("span");
        b.className = "badge warn";
        b.textContent = String(r.risks);
        risks.appendChild(b);
      }
    }
    const prog = tr.querySelector('[data-field="progress"]');
    if (prog) {
      prog.textContent = r.progress ? r.progress.phase : "";
      if (r.progress && r.progress.lastLine) {
        const last = document.createElement("span");
        last.className = "last";
        last.textContent = r.progress.lastLine;
        prog.appendChild(last);
      }
    }
  }

  source.addEventListener("jobs", function (ev) {
    const rows = JSON.parse(ev.data);
    if (page === "list") {
      const table = document.getElementById("jobs");
      for (const r of rows) {
        const tr = table && Array.from(table.querySelectorAll("tr[data-job]")).find(function (t) { return t.dataset.job === r.jobId; });
        if (!tr) {
          // A job this page has not listed (a new one, or filtered differently): the server renders it.
          if (!document.hidden) window.location.reload();
          return;
        }
        updateRow(tr, r);
      }
    } else if (page === "job") {
      const me = rows.find(function (r) { return r.jobId === document.body.dataset.job; });
      if (!me) return;
      if (me.status !== document.body.dataset.status) { window.location.reload(); return; }
      if (me.progress) {
        const phase = document.getElementById("live-phase");
        if (phase) phase.textContent = me.progress.phase;
        const line = document.getElementById("live-line");
        if (line) line.textContent = me.progress.lastLine;
        const el = document.getElementById("live-elapsed");
        if (el && me.progress.elapsedS != null) el.textContent = me.progress.elapsedS + " s";
      }
    }
  });
})();
