// aidn coordinator dashboard: job list, cluster view and job pages, all
// read from the coordinator's JSON API (/api/v1/...).
'use strict';

(() => {
  // ---------------------------------------------------------------------
  // Constants

  const TOKEN_KEY = 'aidn.token';
  const STATES = ['PENDING', 'SCHEDULED', 'RUNNING', 'RESTARTING', 'PAUSED',
    'SUCCEEDED', 'FAILED', 'CANCELLED'];
  const ACTIVE_STATES = new Set(['PENDING', 'SCHEDULED', 'RUNNING', 'RESTARTING', 'PAUSED']);
  const FINISHED_STATES = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED']);
  // Polls after a job ended that wait for its last metric records.
  const FINAL_TRIES = 30;
  // Jobs holding workers (placed, running or coming back after a failure).
  const RUNNING_STATES = new Set(['SCHEDULED', 'RUNNING', 'RESTARTING']);
  // Jobs waiting for free workers.
  const QUEUED_STATES = new Set(['PENDING']);

  const METRICS_PAGE = 10000;   // most steps per /metrics answer
  const EVENTS_PAGE = 1000;     // most events per /events answer
  const LOG_TAIL = 200;
  const REQUEST_TIMEOUT_MS = 15000;
  const CHARTS_MISSING = "charts need Debian's libjs-chart.js";

  const LIST_REFRESH_MS = 2000;
  const JOB_FAST_MS = 1000;
  const JOB_SLOW_MS = 10000;
  const CHECKPOINTS_EVERY_MS = 5000;
  const LOGS_EVERY_MS = 2000;

  // ---------------------------------------------------------------------
  // Small helpers

  // Builds an element. props: className, text, and attributes (true: empty
  // attribute; null/undefined/false: left out). Children are nodes or text.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    if (props) {
      for (const [key, value] of Object.entries(props)) {
        if (value === undefined || value === null || value === false) continue;
        if (key === 'className') node.className = value;
        else if (key === 'text') node.textContent = String(value);
        else node.setAttribute(key, value === true ? '' : String(value));
      }
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // int64 values arrive as strings; anything missing or odd counts as 0.
  function num(value) {
    const n = Number(value);
    return Number.isFinite(n) ? n : 0;
  }

  // A chart value: NaN (a gap) rather than a made-up 0.
  function plotValue(value) {
    const n = Number(value);
    return Number.isFinite(n) ? n : NaN;
  }

  // Milliseconds since the epoch, or null for unset timestamps (absent or
  // the epoch itself).
  function parseTime(ts) {
    if (!ts) return null;
    const ms = Date.parse(ts);
    return Number.isFinite(ms) && ms > 0 ? ms : null;
  }

  // "12s", "5m", "3h", "2d".
  function humanAge(ms) {
    if (ms === null) return '—';
    const s = Math.max(0, Math.floor((Date.now() - ms) / 1000));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }

  function pad2(n) {
    return String(n).padStart(2, '0');
  }

  // Local time, "2026-11-28 07:01:39".
  function formatTime(ms) {
    if (ms === null) return '—';
    const d = new Date(ms);
    return `${d.getFullYear()}-${pad2(d.getMonth() + 1)}-${pad2(d.getDate())} ` +
      `${pad2(d.getHours())}:${pad2(d.getMinutes())}:${pad2(d.getSeconds())}`;
  }

  // A <time> element with the local time and the exact UTC one as tooltip.
  function timeEl(ts, withAge) {
    const ms = parseTime(ts);
    if (ms === null) return el('span', { className: 'muted', text: '—' });
    const text = withAge ? `${formatTime(ms)} (${humanAge(ms)} ago)` : formatTime(ms);
    return el('time', { datetime: new Date(ms).toISOString(), title: new Date(ms).toISOString(), text });
  }

  function humanBytes(value) {
    let n = num(value);
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    if (i === 0) return `${n} B`;
    return `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
  }

  function fixed(value, digits) {
    const n = Number(value);
    return Number.isFinite(n) ? n.toFixed(digits) : '—';
  }

  function percent(fraction) {
    const n = Number(fraction);
    return Number.isFinite(n) ? `${(n * 100).toFixed(2)}%` : '—';
  }

  function labelText(labels) {
    if (!labels || typeof labels !== 'object') return '';
    return Object.keys(labels).sort().map((k) => `${k}=${labels[k]}`).join(', ');
  }

  function stateClass(state) {
    return 'state-' + String(state || 'unknown').toLowerCase().replace(/[^a-z0-9_-]/g, '');
  }

  // The state word, with a colour added by class.
  function stateBadge(state, id) {
    const word = state || 'UNKNOWN';
    return el('span', { className: `badge ${stateClass(word)}`, id, text: word });
  }

  function jobLink(id) {
    return el('a', { href: `#/jobs/${encodeURIComponent(id)}`, text: id });
  }

  function enc(s) {
    return encodeURIComponent(s);
  }

  // Steps done, and the step count the job aims at (0: unknown).
  function progressOf(job) {
    const last = num(job.last_step);
    let total = num(job.total_steps);
    if (total <= 0) total = num(job.spec && job.spec.max_steps);
    return { last, total, fraction: total > 0 ? Math.min(1, last / total) : 0 };
  }

  function progressBar(last, total, id) {
    const bar = el('progress', { id, max: total > 0 ? total : 1, value: total > 0 ? Math.min(last, total) : 0 });
    bar.setAttribute('aria-label', total > 0 ? `step ${last} of ${total}` : `step ${last}`);
    return bar;
  }

  function setText(node, text) {
    const s = String(text);
    if (node.textContent !== s) node.textContent = s;
  }

  function emptyRow(colspan, text) {
    return el('tr', { className: 'empty' }, el('td', { colspan, text }));
  }

  // A table inside a horizontally scrolling box; returns {wrap, table, tbody}.
  function makeTable(headers, id, extraClass) {
    const tbody = el('tbody');
    const table = el('table', { id, className: extraClass },
      el('thead', null, el('tr', null, headers.map((h) => el('th', { scope: 'col', text: h })))),
      tbody);
    const wrap = el('div', { className: 'table-wrap' }, table);
    return { wrap, table, tbody };
  }

  // ---------------------------------------------------------------------
  // Token

  let memoryToken = '';
  // Set when the user closes the token form; a 401 then shows in the page
  // instead of reopening the form on every poll.
  let tokenFormDismissed = false;

  function getToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || '';
    } catch (e) {
      return memoryToken;
    }
  }

  function setToken(token) {
    memoryToken = token;
    try {
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) {
      // Storage unavailable: the in-memory copy serves this page.
    }
    updateTokenStatus();
  }

  function updateTokenStatus() {
    const status = document.getElementById('token-status');
    if (status) status.textContent = getToken() ? 'token set' : 'no token';
  }

  function showTokenForm(message, fromUser) {
    if (!fromUser && tokenFormDismissed) return;
    const panel = document.getElementById('token-panel');
    const msg = document.getElementById('token-message');
    const wasHidden = panel.hidden;
    msg.textContent = message || '';
    msg.hidden = !message;
    panel.hidden = false;
    document.getElementById('token-button').setAttribute('aria-expanded', 'true');
    if (wasHidden) document.getElementById('token-input').focus();
  }

  function hideTokenForm() {
    document.getElementById('token-panel').hidden = true;
    document.getElementById('token-button').setAttribute('aria-expanded', 'false');
  }

  function setupTokenControls() {
    const input = document.getElementById('token-input');
    document.getElementById('token-button').addEventListener('click', () => {
      if (document.getElementById('token-panel').hidden) {
        tokenFormDismissed = false;
        showTokenForm('', true);
      } else {
        tokenFormDismissed = true;
        hideTokenForm();
      }
    });
    document.getElementById('token-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      setToken(input.value.trim());
      input.value = '';
      tokenFormDismissed = false;
      hideTokenForm();
      route();
    });
    document.getElementById('token-clear').addEventListener('click', () => {
      setToken('');
      input.value = '';
      tokenFormDismissed = false;
      hideTokenForm();
      route();
    });
    document.getElementById('token-close').addEventListener('click', () => {
      tokenFormDismissed = true;
      hideTokenForm();
    });
    updateTokenStatus();
  }

  // ---------------------------------------------------------------------
  // API

  class ApiError extends Error {
    constructor(message, status, code) {
      super(message);
      this.name = 'ApiError';
      this.status = status;  // HTTP status; 0 for a network failure
      this.code = code || '';
    }
  }

  function setReconnecting(on) {
    const banner = document.getElementById('reconnecting');
    if (banner && banner.hidden === on) banner.hidden = !on;
  }

  // Fetches an API path with the token. Resolves to the parsed JSON (or the
  // Response with options.raw); rejects with an ApiError. 401 opens the
  // token form; a network failure shows the reconnecting banner.
  async function api(path, options = {}) {
    const headers = { Accept: 'application/json' };
    const token = getToken();
    if (token) headers.Authorization = `Bearer ${token}`;
    if (options.body !== undefined) headers['Content-Type'] = 'application/json';
    const init = { method: options.method || 'GET', headers, body: options.body, cache: 'no-store' };
    const timeout = options.timeout === undefined ? REQUEST_TIMEOUT_MS : options.timeout;
    if (timeout > 0 && typeof AbortSignal !== 'undefined' && AbortSignal.timeout) {
      init.signal = AbortSignal.timeout(timeout);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      setReconnecting(true);
      throw new ApiError('cannot reach the coordinator', 0, 'NETWORK');
    }
    if (resp.ok) {
      setReconnecting(false);
      if (options.raw) return resp;
      try {
        return await resp.json();
      } catch (e) {
        throw new ApiError('the coordinator sent an answer that is not JSON', resp.status, 'INTERNAL');
      }
    }
    let body = null;
    try {
      body = await resp.json();
    } catch (e) {
      body = null;
    }
    const message = body && typeof body.error === 'string' && body.error ? body.error : `HTTP ${resp.status} ${resp.statusText}`.trim();
    // A gateway answering for a coordinator that is down.
    if ([502, 503, 504].includes(resp.status) && !(body && body.error)) {
      setReconnecting(true);
      throw new ApiError('cannot reach the coordinator', 0, 'NETWORK');
    }
    setReconnecting(false);
    if (resp.status === 401) showTokenForm(message);
    throw new ApiError(message, resp.status, body && body.code);
  }

  // An error box for one page: shows API errors, hides on success.
  // Network failures are left to the reconnecting banner.
  function errorBox() {
    const node = el('div', { className: 'error-box', role: 'alert', hidden: true });
    return {
      node,
      show(err) {
        if (err && err.status === 0) return;
        let text = err && err.message ? err.message : String(err);
        if (err && err.status === 401) text = `Authentication needed: ${text}`;
        else if (err && err.code) text = `${text} (${err.code})`;
        setText(node, text);
        node.hidden = false;
      },
      clear() {
        if (!node.hidden) node.hidden = true;
      },
    };
  }

  // ---------------------------------------------------------------------
  // Page lifecycle and polling

  // A page owns its timers and cleanups; stop() runs when the route changes.
  function makePage() {
    const timers = new Set();
    const cleanups = [];
    const page = {
      alive: true,
      later(fn, ms) {
        const t = setTimeout(() => {
          timers.delete(t);
          if (page.alive) fn();
        }, ms);
        timers.add(t);
        return t;
      },
      cancel(t) {
        clearTimeout(t);
        timers.delete(t);
      },
      onStop(fn) {
        cleanups.push(fn);
      },
      stop() {
        page.alive = false;
        for (const t of timers) clearTimeout(t);
        timers.clear();
        for (const fn of cleanups) {
          try {
            fn();
          } catch (e) {
            // Keep tearing down the rest.
          }
        }
      },
    };
    return page;
  }

  // Runs fn again and again; fn resolves to the delay before its next run
  // (null: stop). now() runs it at once (after a run in progress).
  function poller(page, fn) {
    let timer = null;
    let running = false;
    let again = false;
    const run = async () => {
      timer = null;
      if (!page.alive) return;
      if (running) {
        again = true;
        return;
      }
      running = true;
      let delay = LIST_REFRESH_MS;
      try {
        delay = await fn();
      } catch (e) {
        console.error(e);
      } finally {
        running = false;
      }
      if (!page.alive) return;
      if (again) {
        again = false;
        delay = 0;
      }
      if (delay !== null && delay !== undefined) timer = page.later(run, delay);
    };
    return {
      start: run,
      now() {
        if (timer !== null) {
          page.cancel(timer);
          timer = null;
        }
        run();
      },
    };
  }

  // ---------------------------------------------------------------------
  // Router

  let currentPage = null;

  function parseRoute() {
    const hash = location.hash.replace(/^#/, '');
    const parts = hash.split('/').filter(Boolean);
    if (parts.length === 0) return { name: 'jobs' };
    if (parts[0] === 'jobs' && parts.length === 1) return { name: 'jobs' };
    if (parts[0] === 'jobs') {
      try {
        return { name: 'job', id: decodeURIComponent(parts.slice(1).join('/')) };
      } catch (e) {
        return { name: 'notfound' };
      }
    }
    if (parts[0] === 'cluster' && parts.length === 1) return { name: 'cluster' };
    return { name: 'notfound' };
  }

  function route() {
    if (currentPage) currentPage.stop();
    const page = makePage();
    currentPage = page;
    const main = document.getElementById('app');
    main.replaceChildren();
    const r = parseRoute();
    const section = r.name === 'cluster' ? 'cluster' : 'jobs';
    for (const [id, name] of [['nav-jobs', 'jobs'], ['nav-cluster', 'cluster']]) {
      const link = document.getElementById(id);
      if (name === section && r.name !== 'notfound') link.setAttribute('aria-current', 'page');
      else link.removeAttribute('aria-current');
    }
    if (r.name === 'jobs') renderJobsPage(main, page);
    else if (r.name === 'cluster') renderClusterPage(main, page);
    else if (r.name === 'job') renderJobPage(main, page, r.id);
    else renderNotFound(main);
  }

  function renderNotFound(main) {
    document.title = 'aidn';
    main.append(
      el('h1', { text: 'Page not found' }),
      el('p', null, 'Go to the ', el('a', { href: '#/jobs', text: 'job list' }), ' or the ',
        el('a', { href: '#/cluster', text: 'cluster' }), '.'));
  }

  // ---------------------------------------------------------------------
  // Job list (#/jobs)

  const JOB_COLUMNS = [
    { key: 'id', label: 'ID', value: (j) => j.id || '' },
    { key: 'name', label: 'Name', value: (j) => (j.spec && j.spec.name) || '' },
    { key: 'state', label: 'State', value: (j) => j.state || '' },
    { key: 'owner', label: 'Owner', value: (j) => j.owner || '' },
    { key: 'labels', label: 'Labels', value: (j) => labelText(j.spec && j.spec.labels) },
    { key: 'world', label: 'World size', value: (j) => num(j.spec && j.spec.world_size) },
    { key: 'progress', label: 'Progress', value: (j) => progressOf(j).fraction + progressOf(j).last * 1e-12 },
    {
      key: 'age', label: 'Age',
      // Ascending age: newest first.
      value: (j) => {
        const t = parseTime(j.created_at);
        return t === null ? Infinity : -t;
      },
    },
  ];

  // Sort and filter survive leaving and coming back to the list.
  const jobListView = { sortKey: 'age', sortDir: 'asc', filter: '', state: 'all' };

  function compareValues(a, b) {
    if (typeof a === 'number' && typeof b === 'number') return a === b ? 0 : (a < b ? -1 : 1);
    return String(a).localeCompare(String(b), undefined, { numeric: true, sensitivity: 'base' });
  }

  function jobMatches(job, text, stateFilter) {
    if (stateFilter === 'active' && !ACTIVE_STATES.has(job.state)) return false;
    if (stateFilter !== 'all' && stateFilter !== 'active' && job.state !== stateFilter) return false;
    if (!text) return true;
    const hay = [job.id, job.spec && job.spec.name, job.state, job.owner, labelText(job.spec && job.spec.labels)]
      .map((s) => String(s || '').toLowerCase()).join('\n');
    return hay.includes(text);
  }

  function summaryText(jobs) {
    let running = 0;
    let queued = 0;
    let paused = 0;
    let finished = 0;
    for (const j of jobs) {
      if (RUNNING_STATES.has(j.state)) running++;
      else if (QUEUED_STATES.has(j.state)) queued++;
      else if (j.state === 'PAUSED') paused++;
      else if (FINISHED_STATES.has(j.state)) finished++;
    }
    const parts = [`${running} running`, `${queued} queued`];
    if (paused) parts.push(`${paused} paused`);
    parts.push(`${finished} finished`);
    return parts.join(' · ');
  }

  function jobRow(job) {
    const p = progressOf(job);
    const created = parseTime(job.created_at);
    const progressText = p.total > 0 ? `${p.last} / ${p.total}` : String(p.last);
    return el('tr', { 'data-job-id': job.id },
      el('td', { className: 'mono' }, jobLink(job.id)),
      el('td', { text: (job.spec && job.spec.name) || '' }),
      el('td', null, stateBadge(job.state)),
      el('td', { text: job.owner || '' }),
      el('td', { className: 'labels', text: labelText(job.spec && job.spec.labels) }),
      el('td', { className: 'num', text: num(job.spec && job.spec.world_size) }),
      el('td', { className: 'progress-cell' },
        el('span', { className: 'progress-text', text: progressText }), ' ',
        p.total > 0 ? progressBar(p.last, p.total) : null),
      el('td', { className: 'num', title: created === null ? null : new Date(created).toISOString(), text: humanAge(created) }));
  }

  function renderJobsPage(main, page) {
    document.title = 'aidn · Jobs';
    const errors = errorBox();
    const summary = el('p', { className: 'summary', id: 'jobs-summary', 'aria-live': 'polite', text: 'Loading…' });

    const filterInput = el('input', {
      type: 'search', id: 'jobs-filter', placeholder: 'Filter by id, name, state, owner, label',
      'aria-label': 'Filter jobs', value: jobListView.filter,
    });
    const stateSelect = el('select', { id: 'jobs-state', 'aria-label': 'Job state' },
      el('option', { value: 'all', text: 'All' }),
      el('option', { value: 'active', text: 'Active' }),
      STATES.map((s) => el('option', { value: s, text: s })));
    stateSelect.value = jobListView.state;
    const shown = el('span', { className: 'muted', id: 'jobs-shown' });
    const controls = el('div', { className: 'controls' },
      filterInput,
      el('label', { className: 'inline' }, 'State ', stateSelect),
      shown);

    const headerButtons = new Map();
    const headRow = el('tr');
    for (const col of JOB_COLUMNS) {
      const ind = el('span', { className: 'sort-ind', 'aria-hidden': 'true' });
      const button = el('button', { type: 'button', className: 'sort', 'data-key': col.key }, col.label, ind);
      button.addEventListener('click', () => {
        if (jobListView.sortKey === col.key) {
          jobListView.sortDir = jobListView.sortDir === 'asc' ? 'desc' : 'asc';
        } else {
          jobListView.sortKey = col.key;
          jobListView.sortDir = 'asc';
        }
        renderRows();
      });
      const th = el('th', { scope: 'col' }, button);
      headerButtons.set(col.key, { th, ind });
      headRow.append(th);
    }
    const tbody = el('tbody', null, emptyRow(JOB_COLUMNS.length, 'Loading…'));
    const table = el('table', { id: 'jobs-table', className: 'data' }, el('thead', null, headRow), tbody);

    main.append(el('h1', { text: 'Jobs' }), errors.node, summary, controls, el('div', { className: 'table-wrap' }, table));

    let jobs = null;

    function renderRows() {
      for (const [key, { th, ind }] of headerButtons) {
        if (key === jobListView.sortKey) {
          th.setAttribute('aria-sort', jobListView.sortDir === 'asc' ? 'ascending' : 'descending');
          ind.textContent = jobListView.sortDir === 'asc' ? ' ▲' : ' ▼';
        } else {
          th.setAttribute('aria-sort', 'none');
          ind.textContent = '';
        }
      }
      if (jobs === null) return;
      const text = jobListView.filter.trim().toLowerCase();
      const col = JOB_COLUMNS.find((c) => c.key === jobListView.sortKey) || JOB_COLUMNS[JOB_COLUMNS.length - 1];
      const dir = jobListView.sortDir === 'asc' ? 1 : -1;
      const rows = jobs
        .filter((j) => jobMatches(j, text, jobListView.state))
        .map((j) => ({ j, v: col.value(j) }))
        .sort((a, b) => dir * compareValues(a.v, b.v) || compareValues(a.j.id || '', b.j.id || ''))
        .map(({ j }) => jobRow(j));
      if (rows.length === 0) {
        rows.push(emptyRow(JOB_COLUMNS.length, jobs.length === 0 ? 'No jobs yet.' : 'No jobs match the filter.'));
      }
      tbody.replaceChildren(...rows);
      const matched = rows[0].classList.contains('empty') ? 0 : rows.length;
      setText(shown, matched === jobs.length ? `${jobs.length} jobs` : `${matched} of ${jobs.length} jobs`);
    }

    filterInput.addEventListener('input', () => {
      jobListView.filter = filterInput.value;
      renderRows();
    });
    stateSelect.addEventListener('change', () => {
      jobListView.state = stateSelect.value;
      renderRows();
    });

    renderRows();
    poller(page, async () => {
      try {
        const resp = await api('/api/v1/jobs');
        if (!page.alive) return null;
        jobs = Array.isArray(resp.jobs) ? resp.jobs : [];
        errors.clear();
        setText(summary, jobs.length ? summaryText(jobs) : 'No jobs yet.');
        renderRows();
      } catch (e) {
        if (page.alive) errors.show(e);
      }
      return LIST_REFRESH_MS;
    }).start();
  }

  // ---------------------------------------------------------------------
  // Cluster (#/cluster)

  function gpuTitle(gpus) {
    return gpus.map((g) => {
      const mem = num(g.memory_bytes) > 0 ? ` (${humanBytes(g.memory_bytes)})` : '';
      return `GPU ${num(g.index)}: ${g.name || 'unknown'}${mem}`;
    }).join('\n');
  }

  function workerRow(w) {
    const info = w.info || {};
    const gpus = Array.isArray(info.gpus) ? info.gpus : [];
    const beat = parseTime(w.last_heartbeat);
    const jobIds = Array.isArray(w.job_ids) ? w.job_ids : [];
    const jobs = el('td', { className: 'links' });
    jobIds.forEach((id, i) => {
      if (i) jobs.append(', ');
      jobs.append(jobLink(id));
    });
    if (!jobIds.length) jobs.append(el('span', { className: 'muted', text: '—' }));
    const scheduling = el('td', null, stateBadge(w.scheduling || 'SCHEDULABLE'));
    if (w.scheduling_reason) scheduling.append(el('span', { className: 'reason', text: ` ${w.scheduling_reason}` }));
    const hostTitle = [info.address, info.version ? `version ${info.version}` : '', labelText(info.labels)]
      .filter(Boolean).join('\n');
    return el('tr', { 'data-worker-id': info.id },
      el('td', { className: 'mono', text: info.id || '' }),
      el('td', { title: hostTitle || null, text: info.hostname || info.address || '' }),
      el('td', null, stateBadge(w.state)),
      scheduling,
      el('td', { className: 'num', text: `${num(w.cpu_slots_used)}/${num(info.cpu_slots)}` }),
      el('td', { className: gpus.length ? 'num has-tip' : 'num', title: gpus.length ? gpuTitle(gpus) : null, text: `${num(w.gpus_used)}/${gpus.length}` }),
      el('td', { className: 'num', title: beat === null ? null : new Date(beat).toISOString(), text: beat === null ? 'never' : `${humanAge(beat)} ago` }),
      jobs);
  }

  function jobListItems(jobs) {
    if (!jobs.length) return [el('li', { className: 'muted', text: 'None.' })];
    return jobs.map((j) => {
      const p = progressOf(j);
      return el('li', null, jobLink(j.id), ' ',
        el('span', { text: (j.spec && j.spec.name) || '' }), ' ',
        stateBadge(j.state), ' ',
        el('span', { className: 'muted', text: p.total > 0 ? `step ${p.last} of ${p.total}` : `step ${p.last}` }),
        j.owner ? el('span', { className: 'muted', text: ` · ${j.owner}` }) : null);
    });
  }

  function renderClusterPage(main, page) {
    document.title = 'aidn · Cluster';
    const errors = errorBox();
    const summary = el('p', { className: 'summary', id: 'cluster-summary', text: 'Loading…' });
    const workers = makeTable(['ID', 'Host', 'State', 'Scheduling', 'CPU slots', 'GPUs', 'Last heartbeat', 'Jobs'],
      'workers-table', 'data');
    workers.tbody.append(emptyRow(8, 'Loading…'));
    const running = el('ul', { id: 'running-jobs', className: 'job-list' }, el('li', { className: 'muted', text: 'Loading…' }));
    const queued = el('ul', { id: 'queued-jobs', className: 'job-list' }, el('li', { className: 'muted', text: 'Loading…' }));

    main.append(
      el('h1', { text: 'Cluster' }), errors.node, summary,
      el('h2', { text: 'Workers' }), workers.wrap,
      el('div', { className: 'columns' },
        el('section', null, el('h2', { text: 'Running jobs' }), running),
        el('section', null, el('h2', { text: 'Queued jobs' }), queued)));

    poller(page, async () => {
      const [w, j] = await Promise.allSettled([api('/api/v1/workers'), api('/api/v1/jobs')]);
      if (!page.alive) return null;
      const failed = [w, j].find((r) => r.status === 'rejected');
      if (failed) errors.show(failed.reason);
      else errors.clear();
      if (w.status === 'fulfilled') {
        const list = Array.isArray(w.value.workers) ? w.value.workers : [];
        list.sort((a, b) => compareValues((a.info && a.info.id) || '', (b.info && b.info.id) || ''));
        const rows = list.map(workerRow);
        workers.tbody.replaceChildren(...(rows.length ? rows : [emptyRow(8, 'No workers registered.')]));
        const alive = list.filter((x) => x.state === 'ALIVE').length;
        let slots = 0;
        let slotsUsed = 0;
        let gpus = 0;
        let gpusUsed = 0;
        for (const x of list) {
          slots += num(x.info && x.info.cpu_slots);
          slotsUsed += num(x.cpu_slots_used);
          gpus += (x.info && Array.isArray(x.info.gpus)) ? x.info.gpus.length : 0;
          gpusUsed += num(x.gpus_used);
        }
        setText(summary, `${list.length} workers · ${alive} alive · ${slotsUsed}/${slots} CPU slots · ${gpusUsed}/${gpus} GPUs in use`);
      }
      if (j.status === 'fulfilled') {
        const jobs = Array.isArray(j.value.jobs) ? j.value.jobs : [];
        running.replaceChildren(...jobListItems(jobs.filter((x) => RUNNING_STATES.has(x.state))));
        queued.replaceChildren(...jobListItems(jobs.filter((x) => QUEUED_STATES.has(x.state))));
      }
      return LIST_REFRESH_MS;
    }).start();
  }

  // ---------------------------------------------------------------------
  // Job page (#/jobs/<id>)

  const COLORS = {
    blue: '#1f62b3',
    orange: '#c8580a',
    green: '#2a7a36',
    purple: '#7241a8',
  };

  function lineChart(canvas, yTitle, datasets) {
    return new window.Chart(canvas, {
      type: 'line',
      data: {
        datasets: datasets.map((d) => ({
          label: d.label,
          data: [],
          borderColor: d.color,
          backgroundColor: d.color,
          borderWidth: 1.5,
          pointRadius: d.points ? 3 : 0,
          pointHoverRadius: 4,
          pointHitRadius: 6,
          showLine: true,
          spanGaps: true,
          tension: 0,
        })),
      },
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        parsing: false,
        normalized: true,
        interaction: { mode: 'nearest', axis: 'x', intersect: false },
        scales: {
          x: { type: 'linear', title: { display: true, text: 'step' }, ticks: { precision: 0 } },
          y: { title: { display: true, text: yTitle } },
        },
        plugins: {
          legend: { display: true, labels: { boxWidth: 12 } },
          tooltip: { callbacks: { title: (items) => (items.length ? `step ${items[0].parsed.x}` : '') } },
        },
      },
    });
  }

  // A chart card: caption and a box holding only the canvas.
  function chartCard(title, id, label) {
    const canvas = el('canvas', { id, role: 'img', 'aria-label': label });
    const box = el('div', { className: 'chart-box', id: `${id}-box` }, canvas);
    if (!window.Chart) {
      canvas.hidden = true;
      box.classList.add('no-chart');
      box.append(el('p', { className: 'chart-missing', text: CHARTS_MISSING }));
    }
    const card = el('figure', { className: 'chart-card' }, el('figcaption', { text: title }), box);
    return { card, box, canvas };
  }

  function fact(label, valueNode, id) {
    const dd = el('dd', { id });
    if (valueNode instanceof Node) dd.append(valueNode);
    else dd.textContent = valueNode;
    return [el('dt', { text: label }), dd];
  }

  function throughputText(t) {
    if (!t || num(t.steps) <= 0) return '';
    let line = `${fixed(t.samples_per_second, 1)} samples/s`;
    if (num(t.tokens_per_second) > 0) line += ` (${fixed(t.tokens_per_second, 0)} tokens/s)`;
    const ranks = num(t.world_size);
    line += ` on ${ranks} ${ranks === 1 ? 'rank' : 'ranks'}`;
    if (t.baseline_job) {
      const baseRanks = num(t.baseline_world_size);
      line += `; scaling efficiency ${fixed(t.scaling_efficiency, 2)} vs job ${t.baseline_job}` +
        ` (${fixed(t.baseline_samples_per_second, 1)} samples/s on ${baseRanks} ${baseRanks === 1 ? 'rank' : 'ranks'})`;
    } else if (t.note) {
      line += `; ${t.note}`;
    }
    return line;
  }

  function renderJobPage(main, page, jobId) {
    document.title = `aidn · job ${jobId}`;
    const errors = errorBox();
    const loading = el('p', { className: 'loading', text: 'Loading…' });
    main.append(el('p', { className: 'crumbs' }, el('a', { href: '#/jobs', text: '← Jobs' })), errors.node, loading);

    const base = `/api/v1/jobs/${enc(jobId)}`;
    const s = {
      built: false,
      finished: false,
      finalDone: false,
      seen: new Set(),        // "KIND:step" of every record plotted
      nextStep: 0,            // from_step of the next metrics request
      trainPoints: 0,
      useTokens: false,
      throughputSrc: [],      // {x, sps, tps} per TRAIN record
      lastRanks: null,        // newest TRAIN record with per-rank times
      afterSeq: 0,            // events cursor
      lastCheckpoints: 0,
      lastLogs: 0,
      logRequest: 0,
      placement: [],
      specText: null,
      worldSize: 0,
      charts: null,
      dom: {},
    };

    page.onStop(() => {
      if (s.charts) {
        for (const c of Object.values(s.charts)) c.destroy();
        s.charts = null;
      }
      delete window.aidnCharts;
    });

    function build(job) {
      const d = s.dom;
      d.id = el('code', { id: 'job-id', text: job.id || jobId });
      d.name = el('span', { id: 'job-name', className: 'job-name' });
      d.state = stateBadge(job.state, 'job-state');
      d.step = el('span', { id: 'job-step', className: 'step-number', text: '0' });
      d.stepTotal = el('span', { id: 'job-step-total', className: 'muted' });
      d.progress = progressBar(0, 0, 'job-progress');
      d.message = el('p', { id: 'job-message', className: 'job-message', hidden: true });
      d.throughput = el('p', { id: 'job-throughput', className: 'throughput', hidden: true });
      d.owner = el('span');
      d.generation = el('span');
      d.restarts = el('span');
      d.epoch = el('span');
      d.checkpointStep = el('span');
      d.world = el('span');
      d.model = el('span');
      d.created = el('span');
      d.started = el('span');
      d.finished = el('span');
      d.pause = el('button', { type: 'button', id: 'pause-job', text: 'Pause', hidden: true });
      d.resume = el('button', { type: 'button', id: 'resume-job', text: 'Resume', hidden: true });
      d.cancel = el('button', { type: 'button', id: 'cancel-job', className: 'danger', text: 'Cancel job', hidden: true });
      d.action = el('p', { id: 'action-message', className: 'action-message', role: 'status', 'aria-live': 'polite' });

      const header = el('section', { className: 'job-header', 'aria-label': 'Job' },
        el('div', { className: 'job-title' },
          el('h1', null, 'Job ', d.id, ' ', d.name),
          el('div', { className: 'job-actions' }, d.pause, d.resume, d.cancel)),
        el('div', { className: 'job-status' },
          d.state,
          el('span', { className: 'step-line' }, 'Step ', d.step, ' ', d.stepTotal),
          d.progress),
        d.message,
        d.throughput,
        d.action,
        el('dl', { className: 'facts' },
          fact('Owner', d.owner), fact('Generation', d.generation), fact('Restarts', d.restarts),
          fact('Epoch', d.epoch), fact('Last checkpoint', d.checkpointStep), fact('World size', d.world),
          fact('Model', d.model), fact('Created', d.created), fact('Started', d.started),
          fact('Finished', d.finished)));

      // Charts
      const loss = chartCard('Loss', 'chart-loss', 'Training and test loss by step');
      const thr = chartCard('Throughput', 'chart-throughput', 'Throughput by step');
      const stepTime = chartCard('Step time', 'chart-step-time', 'Step time in seconds by step');
      d.lossBox = loss.box;
      d.lossBox.setAttribute('data-points', '0');
      if (window.Chart) {
        s.charts = {
          loss: lineChart(loss.canvas, 'loss', [
            { label: 'train loss', color: COLORS.blue },
            { label: 'test loss', color: COLORS.orange, points: true },
          ]),
          throughput: lineChart(thr.canvas, 'samples/s', [{ label: 'samples/s', color: COLORS.green }]),
          stepTime: lineChart(stepTime.canvas, 'seconds', [
            { label: 'step seconds (slowest rank)', color: COLORS.purple },
            { label: 'allreduce seconds', color: COLORS.orange },
          ]),
        };
        window.aidnCharts = s.charts;
      }
      const charts = el('section', { className: 'charts', 'aria-label': 'Charts' }, loss.card, thr.card, stepTime.card);

      // Evaluation and per-rank tables
      d.evalTable = makeTable(['Step', 'Epoch', 'Test loss', 'Test accuracy'], 'eval-table', 'data compact');
      d.evalTable.tbody.append(emptyRow(4, 'No evaluation yet.'));
      d.rankCaption = el('p', { className: 'muted', id: 'rank-caption', text: 'No step reported yet.' });
      d.rankTable = makeTable(['Rank', 'Worker', 'Step seconds', 'Allreduce seconds', ''], 'rank-table', 'data compact');

      // Spec
      d.spec = el('pre', { id: 'job-spec', className: 'spec' });

      // History and events
      d.history = el('ol', { id: 'generation-history', className: 'history' },
        el('li', { className: 'muted empty', text: 'No job events yet.' }));
      d.events = makeTable(['Seq', 'Time', 'Type', 'Worker', 'Message'], 'events-table', 'data compact');
      d.events.tbody.append(emptyRow(5, 'No events yet.'));

      // Checkpoints
      d.checkpoints = makeTable(['Step', 'Generation', 'Committed', 'Size', 'Created', 'State', 'Export'],
        'checkpoints-table', 'data compact');
      d.checkpoints.tbody.append(emptyRow(7, 'Loading…'));
      d.checkpointMessage = el('p', { id: 'checkpoint-message', className: 'action-message', role: 'status', 'aria-live': 'polite' });

      // Logs
      d.follow = el('input', { type: 'checkbox', id: 'logs-follow', checked: true });
      d.logRank = el('select', { id: 'logs-rank', 'aria-label': 'Rank' }, el('option', { value: '', text: 'All ranks' }));
      d.logs = el('pre', { id: 'job-logs', className: 'logs', tabindex: '0', 'aria-label': 'Job log' });
      d.logNote = el('p', { id: 'logs-note', className: 'muted', text: 'Loading…' });

      main.append(
        header,
        charts,
        el('div', { className: 'columns' },
          el('section', { 'aria-labelledby': 'eval-title' },
            el('h2', { id: 'eval-title', text: 'Validation' }), el('div', { className: 'scroll-y' }, d.evalTable.wrap)),
          el('section', { 'aria-labelledby': 'ranks-title' },
            el('h2', { id: 'ranks-title', text: 'Per-rank step times' }), d.rankCaption, d.rankTable.wrap)),
        el('details', { className: 'spec-details', id: 'job-spec-details' }, el('summary', { text: 'Spec' }), d.spec),
        el('section', { 'aria-labelledby': 'history-title' },
          el('h2', { id: 'history-title', text: 'Generation history' }), d.history),
        el('section', { 'aria-labelledby': 'checkpoints-title' },
          el('h2', { id: 'checkpoints-title', text: 'Checkpoints' }), d.checkpointMessage, d.checkpoints.wrap),
        el('section', { 'aria-labelledby': 'logs-title' },
          el('div', { className: 'section-head' },
            el('h2', { id: 'logs-title', text: 'Logs' }),
            el('div', { className: 'controls' },
              el('label', { className: 'inline' }, d.follow, ' Follow'),
              el('label', { className: 'inline' }, 'Rank ', d.logRank))),
          d.logNote, d.logs),
        el('section', { 'aria-labelledby': 'events-title' },
          el('h2', { id: 'events-title', text: 'Events' }), el('div', { className: 'scroll-y' }, d.events.wrap)));

      d.cancel.addEventListener('click', () => jobAction('cancel'));
      d.pause.addEventListener('click', () => jobAction('pause'));
      d.resume.addEventListener('click', () => jobAction('resume'));
      d.follow.addEventListener('change', () => {
        if (d.follow.checked) refreshLogs();
      });
      d.logRank.addEventListener('change', refreshLogs);
      loading.remove();
      s.built = true;
    }

    // ---- header

    function renderHeader(job) {
      const d = s.dom;
      const spec = job.spec || {};
      const p = progressOf(job);
      setText(d.name, spec.name || '');
      setText(d.state, job.state || 'UNKNOWN');
      d.state.className = `badge ${stateClass(job.state)}`;
      setText(d.step, String(p.last));
      setText(d.stepTotal, p.total > 0 ? `of ${p.total}` : '');
      d.stepTotal.hidden = !(p.total > 0);
      d.progress.max = p.total > 0 ? p.total : 1;
      d.progress.value = p.total > 0 ? Math.min(p.last, p.total) : 0;
      d.progress.setAttribute('aria-label', p.total > 0 ? `step ${p.last} of ${p.total}` : `step ${p.last}`);
      setText(d.message, job.message || '');
      d.message.hidden = !job.message;
      const thr = throughputText(job.throughput);
      setText(d.throughput, thr);
      d.throughput.hidden = !thr;
      setText(d.owner, job.owner || '—');
      setText(d.generation, String(num(job.generation)));
      setText(d.restarts, String(num(job.restarts)));
      setText(d.epoch, String(num(job.epoch)));
      setText(d.checkpointStep, num(job.last_checkpoint_step) > 0 ? String(num(job.last_checkpoint_step)) : '—');
      setText(d.world, String(num(spec.world_size)));
      const model = spec.model && spec.model.name ? spec.model.name : '';
      setText(d.model, [model, spec.strategy, spec.device].filter((x) => x && x !== 'UNSPECIFIED').join(' · ') || '—');
      d.created.replaceChildren(timeEl(job.created_at, true));
      d.started.replaceChildren(timeEl(job.started_at, false));
      d.finished.replaceChildren(timeEl(job.finished_at, false));
      d.cancel.hidden = FINISHED_STATES.has(job.state);
      d.pause.hidden = FINISHED_STATES.has(job.state) || job.state === 'PAUSED';
      d.resume.hidden = job.state !== 'PAUSED';
      s.placement = Array.isArray(job.placement) ? job.placement : [];

      const specText = JSON.stringify(spec, null, 2);
      if (specText !== s.specText) {
        s.specText = specText;
        d.spec.textContent = specText;
      }
      const world = num(spec.world_size);
      if (world !== s.worldSize) {
        s.worldSize = world;
        const keep = d.logRank.value;
        const options = [el('option', { value: '', text: 'All ranks' })];
        for (let r = 0; r < world; r++) options.push(el('option', { value: String(r), text: `rank ${r}` }));
        d.logRank.replaceChildren(...options);
        d.logRank.value = keep !== '' && Number(keep) < world ? keep : '';
      }
      if (s.lastRanks) renderRanks();
    }

    // ---- metrics

    function addMetrics(steps) {
      const charts = s.charts;
      const d = s.dom;
      const evalRows = [];
      for (const m of steps) {
        const step = num(m.step);
        const kind = m.kind === 'EVAL' ? 'EVAL' : 'TRAIN';
        const key = `${kind}:${step}`;
        if (s.seen.has(key)) continue;
        s.seen.add(key);
        if (kind === 'EVAL') {
          if (charts) charts.loss.data.datasets[1].data.push({ x: step, y: plotValue(m.test_loss) });
          const acc = num(m.test_accuracy);
          evalRows.push(el('tr', null,
            el('td', { className: 'num', text: step }),
            el('td', { className: 'num', text: num(m.epoch) }),
            el('td', { className: 'num', text: fixed(m.test_loss, 4) }),
            el('td', { className: 'num', text: acc > 0 ? percent(acc) : '—' })));
          continue;
        }
        s.trainPoints++;
        const tps = num(m.tokens_per_second);
        const src = { x: step, sps: plotValue(m.samples_per_second), tps: plotValue(m.tokens_per_second) };
        s.throughputSrc.push(src);
        if (charts) {
          charts.loss.data.datasets[0].data.push({ x: step, y: plotValue(m.loss) });
          charts.stepTime.data.datasets[0].data.push({ x: step, y: plotValue(m.step_seconds) });
          charts.stepTime.data.datasets[1].data.push({ x: step, y: plotValue(m.allreduce_seconds) });
          if (tps > 0 && !s.useTokens) {
            // A language model: plot tokens/s from here on, redrawn from the start.
            s.useTokens = true;
            const ds = charts.throughput.data.datasets[0];
            ds.label = 'tokens/s';
            charts.throughput.options.scales.y.title.text = 'tokens/s';
            ds.data = s.throughputSrc.map((p) => ({ x: p.x, y: p.tps }));
          } else {
            charts.throughput.data.datasets[0].data.push({ x: step, y: s.useTokens ? src.tps : src.sps });
          }
        } else if (tps > 0) {
          s.useTokens = true;
        }
        if (Array.isArray(m.rank_step_seconds) && m.rank_step_seconds.length &&
            (!s.lastRanks || step >= num(s.lastRanks.step))) {
          s.lastRanks = m;
        }
      }
      if (evalRows.length) {
        const empty = d.evalTable.tbody.querySelector('tr.empty');
        if (empty) empty.remove();
        d.evalTable.tbody.append(...evalRows);
      }
      d.lossBox.setAttribute('data-points', String(s.trainPoints));
      if (charts) {
        for (const c of Object.values(charts)) c.update('none');
      }
      if (s.lastRanks) renderRanks();
    }

    function renderRanks() {
      const m = s.lastRanks;
      const d = s.dom;
      const world = num(m.world_size) || m.rank_step_seconds.length;
      const slowest = num(m.slowest_rank);
      const workerOf = new Map(s.placement.map((p) => [num(p.rank), p.worker_id || '']));
      const allreduce = Array.isArray(m.rank_allreduce_seconds) ? m.rank_allreduce_seconds : [];
      setText(d.rankCaption, `Step ${num(m.step)} · ${num(m.ranks_reported) || m.rank_step_seconds.length} of ${world} ranks reported`);
      const rows = m.rank_step_seconds.map((sec, rank) => {
        const straggler = world > 1 && rank === slowest;
        return el('tr', { className: straggler ? 'straggler' : null },
          el('td', { className: 'num', text: rank }),
          el('td', { className: 'mono', text: workerOf.get(rank) || '—' }),
          el('td', { className: 'num', text: num(sec) > 0 ? fixed(sec, 3) : '—' }),
          el('td', { className: 'num', text: allreduce.length > rank && num(allreduce[rank]) > 0 ? fixed(allreduce[rank], 3) : '—' }),
          el('td', null, straggler ? el('span', { className: 'badge straggler-badge', text: 'straggler' }) : null));
      });
      d.rankTable.tbody.replaceChildren(...rows);
    }

    async function pollMetrics() {
      for (let pageNo = 0; pageNo < 100; pageNo++) {
        const resp = await api(`${base}/metrics?from_step=${s.nextStep}`);
        if (!page.alive) return;
        const steps = Array.isArray(resp.steps) ? resp.steps : [];
        addMetrics(steps);
        if (steps.length) {
          const last = steps[steps.length - 1];
          const lastStep = num(last.step);
          // A step's EVAL row may be stored after its TRAIN row: read the
          // last step again until its EVAL row has been seen (the Set drops
          // the repeated TRAIN row).
          const from = s.nextStep;
          s.nextStep = Math.max(from, last.kind === 'EVAL' ? lastStep + 1 : lastStep);
          // A full answer must move the cursor on.
          if (steps.length >= METRICS_PAGE && s.nextStep <= from) s.nextStep = lastStep + 1;
        }
        if (steps.length < METRICS_PAGE) return;
      }
    }

    // ---- events

    async function pollEvents() {
      for (let pageNo = 0; pageNo < 50; pageNo++) {
        const resp = await api(`${base}/events?after_seq=${s.afterSeq}`);
        if (!page.alive) return;
        const events = Array.isArray(resp.events) ? resp.events : [];
        const rows = [];
        const history = [];
        for (const e of events) {
          const seq = num(e.seq);
          if (seq <= s.afterSeq) continue;
          s.afterSeq = seq;
          const type = e.type || '';
          rows.push(el('tr', null,
            el('td', { className: 'num', text: seq }),
            el('td', { className: 'nowrap' }, timeEl(e.time, false)),
            el('td', { className: 'mono', text: type }),
            el('td', { className: 'mono', text: e.worker_id || '' }),
            el('td', { className: 'message', text: e.message || '' })));
          if (type.startsWith('job.')) {
            history.push(el('li', null,
              timeEl(e.time, false), ' ',
              el('span', { className: 'gen', text: `gen ${num(e.generation)}` }), ' ',
              el('code', { text: type }), ' ',
              el('span', { text: e.message || '' })));
          }
        }
        const d = s.dom;
        if (rows.length) {
          const empty = d.events.tbody.querySelector('tr.empty');
          if (empty) empty.remove();
          d.events.tbody.append(...rows);
        }
        if (history.length) {
          const empty = d.history.querySelector('li.empty');
          if (empty) empty.remove();
          d.history.append(...history);
        }
        if (events.length < EVENTS_PAGE) return;
      }
    }

    // ---- checkpoints

    async function exportCheckpoint(step) {
      const msg = s.dom.checkpointMessage;
      const file = `${jobId}-step${step}.safetensors`;
      msg.classList.remove('error');
      msg.textContent = `Exporting step ${step}…`;
      try {
        const resp = await api(`${base}/checkpoints/${enc(step)}/model.safetensors`, { raw: true, timeout: 0 });
        const blob = await resp.blob();
        const url = URL.createObjectURL(blob);
        const a = el('a', { href: url, download: file, className: 'hidden' });
        document.body.append(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 60000);
        msg.textContent = `Exported ${file} (${humanBytes(blob.size)}).`;
      } catch (e) {
        msg.classList.add('error');
        msg.textContent = `Export of step ${step} failed: ${e.message}`;
      }
    }

    function checkpointRow(c) {
      const step = String(num(c.step));
      const valid = !c.invalid_reason;
      let exportCell = el('span', { className: 'muted', text: '—' });
      if (c.committed && valid) {
        exportCell = el('a', {
          href: `${base}/checkpoints/${enc(step)}/model.safetensors`,
          download: `${jobId}-step${step}.safetensors`,
          className: 'export',
          text: 'export',
        });
        exportCell.addEventListener('click', (ev) => {
          ev.preventDefault();
          exportCheckpoint(step);
        });
      }
      return el('tr', { className: valid ? null : 'invalid' },
        el('td', { className: 'num', text: step }),
        el('td', { className: 'num', text: num(c.generation) }),
        el('td', { text: c.committed ? 'yes' : 'no' }),
        el('td', { className: 'num', title: c.path || null, text: num(c.bytes) > 0 ? humanBytes(c.bytes) : '—' }),
        el('td', { className: 'nowrap' }, timeEl(c.created_at, false)),
        el('td', { className: 'state-cell' }, valid ? el('span', { className: 'badge state-valid', text: 'valid' })
          : el('span', null, el('span', { className: 'badge state-invalid', text: 'invalid' }), `: ${c.invalid_reason}`)),
        el('td', null, exportCell));
    }

    async function pollCheckpoints() {
      s.lastCheckpoints = Date.now();
      const resp = await api(`${base}/checkpoints`);
      if (!page.alive) return;
      const list = Array.isArray(resp.checkpoints) ? resp.checkpoints : [];
      const rows = list.map(checkpointRow);
      s.dom.checkpoints.tbody.replaceChildren(...(rows.length ? rows : [emptyRow(7, 'No checkpoints yet.')]));
    }

    // ---- logs

    async function pollLogs() {
      s.lastLogs = Date.now();
      const d = s.dom;
      const rank = d.logRank.value;
      const request = ++s.logRequest;
      const resp = await api(`${base}/logs?tail=${LOG_TAIL}${rank !== '' ? `&rank=${enc(rank)}` : ''}`);
      if (!page.alive || request !== s.logRequest) return;  // a newer request is on its way
      const lines = Array.isArray(resp.lines) ? resp.lines : [];
      const text = lines.map((l) => `[rank ${num(l.rank)}] ${l.text || ''}`).join('\n');
      if (d.logs.textContent !== text) d.logs.textContent = text;
      const dropped = num(resp.dropped_lines);
      const notes = [];
      if (!lines.length) notes.push('No log lines yet.');
      else notes.push(`Last ${lines.length} lines of generation ${num(lines[lines.length - 1].generation)}.`);
      if (dropped > 0) notes.push(`${dropped} lines dropped.`);
      setText(d.logNote, notes.join(' '));
      if (d.follow.checked) d.logs.scrollTop = d.logs.scrollHeight;
    }

    function refreshLogs() {
      pollLogs().catch((e) => {
        if (page.alive) errors.show(e);
      });
    }

    // ---- cancel

    // Cancel, pause or resume, each confirmed first.
    const ACTIONS = {
      cancel: { ask: 'Cancel', doing: 'Cancelling…', done: 'Cancelled.', reason: 'cancelled from the web UI' },
      pause: {
        ask: 'Pause', doing: 'Asking to pause…', reason: 'paused from the web UI',
        done: 'Pause asked: the ranks checkpoint at a step they agree on, then the job stops.',
      },
      resume: { ask: 'Resume', doing: 'Resuming…', done: 'Queued again: it resumes from its newest checkpoint.' },
    };

    async function jobAction(verb) {
      const d = s.dom;
      const action = ACTIONS[verb];
      if (!window.confirm(`${action.ask} job ${jobId}?`)) return;
      const buttons = [d.cancel, d.pause, d.resume];
      for (const b of buttons) b.disabled = true;
      d.action.classList.remove('error');
      d.action.textContent = action.doing;
      try {
        const job = await api(`${base}/${verb}`, {
          method: 'POST',
          body: JSON.stringify(action.reason ? { reason: action.reason } : {}),
        });
        if (!page.alive) return;
        d.action.textContent = action.done;
        renderHeader(job);
        poll.now();
      } catch (e) {
        if (!page.alive) return;
        d.action.classList.add('error');
        d.action.textContent = `Could not ${verb} job ${jobId}: ${e.message}`;
      } finally {
        for (const b of buttons) b.disabled = false;
      }
    }

    // ---- polling

    async function tick() {
      let job;
      try {
        job = await api(base);
      } catch (e) {
        if (!page.alive) return null;
        errors.show(e);
        if (!s.built && e.status === 404) {
          loading.textContent = `Job ${jobId} not found.`;
          return JOB_SLOW_MS;
        }
        if (!s.built && e.status !== 0) loading.hidden = true;
        return s.finished ? JOB_SLOW_MS : JOB_FAST_MS;
      }
      if (!page.alive) return null;
      errors.clear();
      if (!s.built) build(job);
      renderHeader(job);
      const finished = FINISHED_STATES.has(job.state);
      s.finished = finished;
      if (!finished) {
        s.finalDone = false;
        s.finalTries = 0;
      }
      if (finished && s.finalDone) return JOB_SLOW_MS;

      // While running: metrics and events every second, checkpoints every
      // 5 s, logs every 2 s when following. Once finished: all of them once.
      const now = Date.now();
      const tasks = [pollMetrics(), pollEvents()];
      if (finished || now - s.lastCheckpoints >= CHECKPOINTS_EVERY_MS) tasks.push(pollCheckpoints());
      if (s.dom.follow.checked && (finished || now - s.lastLogs >= LOGS_EVERY_MS)) tasks.push(pollLogs());
      const results = await Promise.allSettled(tasks);
      if (!page.alive) return null;
      const failed = results.find((r) => r.status === 'rejected');
      if (failed) errors.show(failed.reason);
      if (finished) {
        if (failed) return JOB_FAST_MS;
        // The last records may be stored a moment after the job ended:
        // keep reading (for at most FINAL_TRIES polls) until they are in.
        s.finalTries = (s.finalTries || 0) + 1;
        if (s.nextStep < num(job.last_step) && s.finalTries < FINAL_TRIES) return JOB_FAST_MS;
        s.finalDone = true;
        return JOB_SLOW_MS;
      }
      return JOB_FAST_MS;
    }

    const poll = poller(page, tick);
    poll.start();
  }

  // ---------------------------------------------------------------------
  // Start

  function start() {
    setupTokenControls();
    window.addEventListener('hashchange', route);
    route();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
