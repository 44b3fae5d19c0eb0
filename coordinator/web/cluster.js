// The cluster (#/cluster): workers, running and queued jobs.
'use strict';

(() => {
  const {
    RUNNING_STATES, QUEUED_STATES, LIST_REFRESH_MS, el, num, parseTime, humanAge, humanBytes,
    labelText, stateBadge, jobLink, progressOf, setText, emptyRow, makeTable, api, errorBox, poller,
    compareValues,
  } = window.aidnUi;

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

  Object.assign(window.aidnUi, { renderClusterPage });
})();
