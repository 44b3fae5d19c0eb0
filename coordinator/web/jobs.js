// The job list (#/jobs): sortable, filtered, refreshed.
'use strict';

(() => {
  const {
    STATES, ACTIVE_STATES, FINISHED_STATES, RUNNING_STATES, QUEUED_STATES, LIST_REFRESH_MS, el, num,
    parseTime, humanAge, labelText, stateBadge, jobLink, progressOf, progressBar, setText, emptyRow,
    api, errorBox, poller, compareValues,
  } = window.aidnUi;

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

  Object.assign(window.aidnUi, { renderJobsPage });
})();
