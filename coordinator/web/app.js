// The web UI's entry: routes #/jobs, #/cluster and #/jobs/ID to their pages
// (common.js, jobs.js, cluster.js and job.js, loaded before it).
'use strict';

(() => {
  const {
    el, setupTokenControls, makePage, renderJobsPage, renderClusterPage, renderJobPage,
  } = window.aidnUi;

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
  // Start

  function start() {
    setupTokenControls();
    window.addEventListener('hashchange', route);
    route();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();

  Object.assign(window.aidnUi, { route });
})();
