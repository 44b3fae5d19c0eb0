// The web UI's shared parts: constants, DOM and formatting helpers, the
// token, the API client and page timers, in window.aidnUi. Each page's
// script (jobs.js, cluster.js, job.js) takes what it needs from there and
// adds its page; app.js routes. All of it reads the coordinator's JSON API
// (/api/v1/...).
'use strict';

(() => {
  const ui = {};
  window.aidnUi = ui;

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
      ui.route();
    });
    document.getElementById('token-clear').addEventListener('click', () => {
      setToken('');
      input.value = '';
      tokenFormDismissed = false;
      hideTokenForm();
      ui.route();
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


  function compareValues(a, b) {
    if (typeof a === 'number' && typeof b === 'number') return a === b ? 0 : (a < b ? -1 : 1);
    return String(a).localeCompare(String(b), undefined, { numeric: true, sensitivity: 'base' });
  }

  Object.assign(ui, {
    TOKEN_KEY, STATES, ACTIVE_STATES, FINISHED_STATES, FINAL_TRIES, RUNNING_STATES, QUEUED_STATES,
    METRICS_PAGE, EVENTS_PAGE, LOG_TAIL, REQUEST_TIMEOUT_MS, CHARTS_MISSING, LIST_REFRESH_MS,
    JOB_FAST_MS, JOB_SLOW_MS, CHECKPOINTS_EVERY_MS, LOGS_EVERY_MS, el, num, plotValue, parseTime,
    humanAge, pad2, formatTime, timeEl, humanBytes, fixed, percent, labelText, stateClass,
    stateBadge, jobLink, enc, progressOf, progressBar, setText, emptyRow, makeTable, getToken,
    setToken, updateTokenStatus, showTokenForm, hideTokenForm, setupTokenControls, setReconnecting,
    api, errorBox, makePage, poller, compareValues,
  });
})();
