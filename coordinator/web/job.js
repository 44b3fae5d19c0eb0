// A job's page (#/jobs/ID): header and actions, live charts, validation,
// per-rank times, spec, history, events, checkpoints and logs.
'use strict';

(() => {
  const {
    FINISHED_STATES, FINAL_TRIES, METRICS_PAGE, EVENTS_PAGE, LOG_TAIL, CHARTS_MISSING, JOB_FAST_MS,
    JOB_SLOW_MS, CHECKPOINTS_EVERY_MS, LOGS_EVERY_MS, el, num, plotValue, timeEl, humanBytes, fixed,
    percent, stateClass, stateBadge, enc, progressOf, progressBar, setText, emptyRow, makeTable,
    api, errorBox, poller,
  } = window.aidnUi;

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

  Object.assign(window.aidnUi, { renderJobPage });
})();
