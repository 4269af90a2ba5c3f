/* The resilient-train dashboard page: renders a snapshot (monitors/dashboard/model.py).
 * Live: snapshots arrive as server-sent events from api/stream, read with fetch so that every
 * request carries the X-Dashboard-Token header (the server refuses reads without it; EventSource
 * cannot send a header). The token comes from the URL's fragment, which browsers never send.
 * Exported: one snapshot is embedded in the page (#rt-data) and nothing is fetched. */
(function () {
  'use strict';

  var SEGMENTS = {
    detect: {label: 'detect', color: '#d1495b'},
    abort: {label: 'abort', color: '#edae49'},
    rendezvous: {label: 'rendezvous', color: '#8e6fd8'},
    heal: {label: 'heal', color: '#00798c'},
    other: {label: 'other', color: '#a3acb9'},
    first_step: {label: 'first step', color: '#30638e'},
    recovering: {label: 'in progress', color: '#d9dde3'}
  };
  var SEG_ORDER = ['detect', 'abort', 'rendezvous', 'heal', 'other', 'first_step', 'recovering'];
  var HEAT_COLORS = ['#7f0000', '#c62828', '#ef5350', '#f59e8b', '#fcd5c8', '#f3f7f2'];

  var embedded = document.getElementById('rt-data');
  var LIVE = !embedded;
  var ui = {metric: 'relative', k: 16, data: null, source: null, openDetails: {}};
  var charts = {};

  function $(id) { return document.getElementById(id); }
  function esc(s) {
    return String(s === null || s === undefined ? '' : s).replace(/[&<>"']/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c];
    });
  }
  function num(v, d) { return (v === null || v === undefined || isNaN(v)) ? '–' : Number(v).toFixed(d === undefined ? 2 : d); }
  function secs(v) {
    if (v === null || v === undefined || isNaN(v)) return '–';
    if (v === 0) return '0';
    if (v < 0.01) return (v * 1000).toFixed(1) + ' ms';
    if (v < 1) return (v * 1000).toFixed(0) + ' ms';
    if (v < 100) return v.toFixed(2) + ' s';
    if (v < 3600) return Math.floor(v / 60) + ' min ' + Math.round(v % 60) + ' s';
    return (v / 3600).toFixed(1) + ' h';
  }
  function at(t) { return (t === null || t === undefined) ? '–' : 't=' + secs(t); }
  function metricLabel(m) {
    if (m === 'relative') return 'relative (vs the fastest rank)';
    if (m === 'individual') return 'individual (vs its own best)';
    return 'section ' + m.replace('section:', '') + ' (vs the fastest rank)';
  }
  function chart(id) {
    if (!charts[id]) charts[id] = echarts.init($(id), null, {renderer: 'canvas'});
    return charts[id];
  }
  window.addEventListener('resize', function () { Object.keys(charts).forEach(function (k) { charts[k].resize(); }); });

  // ---------------------------------------------------------------- header
  function renderHeader(d) {
    var r = d.run;
    $('run-dir').textContent = r.dir + (r.script ? '  ·  ' + r.script : '');
    if (LIVE) document.title = 'resilient-train: ' + String(r.dir).split('/').filter(Boolean).pop();  // the server's says nothing
    var st = $('run-state');
    var label = r.state === 'failed' ? 'failed' + (r.reason ? ': ' + r.reason : '') : r.state;
    st.textContent = label;
    st.className = 'pill ' + (r.state === 'running' ? 'running' : r.state === 'finished' ? 'finished' : r.state === 'failed' ? 'failed' : '');
    st.dataset.state = r.state;
    if (!LIVE) {
      $('live').textContent = 'exported ' + new Date((d.exported_at || d.generated_at) * 1000).toLocaleString();
    }
    var s = d.straggler, rate = d.steps.rate_now;
    var kpis = [
      r.width ? ['processes / logical ranks', r.width.processes + ' / ' + r.width.logical, r.width.processes < r.width.logical]
              : ['ranks', r.world_size === null ? '–' : r.world_size],
      ['step', r.step === null ? '–' : r.step],
      ['steps/s', rate === null ? '–' : num(rate, 1)],
      ['generation', r.generation === null ? '–' : r.generation],
      ['faults', r.faults, r.faults > 0],
      ['replacements', r.restarts],
      ['flagged ranks', s.flagged_total, s.flagged_total > 0],
      ['elapsed', secs(r.elapsed_s)],
      r.state === 'running' ? ['since last event', secs(r.last_event_age_s)] : ['final state', r.final_state ? 'written' : 'none', !r.final_state]
    ];
    $('kpis').innerHTML = kpis.map(function (k) {
      return '<div class="kpi"><div class="label">' + esc(k[0]) + '</div><div class="value' + (k[2] ? ' bad' : '') + '">' + esc(k[1]) + '</div></div>';
    }).join('');
    $('footer').textContent = d.events.total + ' events read' +
      (Object.keys(d.events.unknown).length ? '; not shown: ' + Object.keys(d.events.unknown).map(function (k) { return k + ' ×' + d.events.unknown[k]; }).join(', ') : '') +
      (d.events.unparsed_lines ? '; ' + d.events.unparsed_lines + ' torn lines skipped' : '');
  }

  // ------------------------------------------------------------- stragglers
  function renderDetection(s) {
    var rep = s.reported, req = s.requested, cfg = s.config || {};
    var chip = $('detection-state');
    var enabled = rep ? rep.enabled !== false : (cfg.enabled !== false);
    chip.textContent = 'detection ' + (enabled ? 'on' : 'off');
    chip.className = 'state-chip ' + (enabled ? 'on' : 'off');
    chip.dataset.enabled = String(enabled);
    chip.dataset.interval = rep ? String(rep.interval) : '';
    chip.dataset.controlReadAt = rep && rep.control_read_at ? String(rep.control_read_at) : '';
    var bits = [];
    if (rep) bits.push('as of report #' + rep.interval + ' (' + at(rep.t) + ')');
    else bits.push('no report yet');
    if (s.threshold !== null && s.threshold !== undefined) bits.push('threshold ' + s.threshold);
    if (cfg.report_interval_s) bits.push('every ' + cfg.report_interval_s + ' s');
    if (cfg.patience) bits.push('patience ' + cfg.patience);
    if (cfg.policy) bits.push('policy ' + cfg.policy);
    var pending = req && req.at && (!rep || !rep.control_read_at || rep.control_read_at < req.at);
    if (pending) bits.push('change requested: ' + (req.enabled === false ? 'off' : req.enabled === true ? 'on' : '') +
      (req.threshold ? ' threshold ' + req.threshold : '') + ', waiting for the next report');
    $('detection-detail').textContent = bits.join(' · ');
    var msg = $('control-msg');
    if (ui.requestedAt && rep && rep.control_read_at && rep.control_read_at >= ui.requestedAt) {
      msg.textContent = 'applied: report #' + rep.interval + ' says detection ' + (enabled ? 'on' : 'off') + ', threshold ' + rep.threshold;
      msg.dataset.applied = String(rep.interval);
      ui.requestedAt = null;
    }
    $('toggle-detection').textContent = enabled ? 'Turn detection off' : 'Turn detection on';
    $('toggle-detection').dataset.next = enabled ? 'off' : 'on';
    var live = ui.data && (ui.data.run.state === 'running' || ui.data.run.state === 'no events yet');  // a finished job has nothing to steer
    ['toggle-detection', 'apply-threshold', 'threshold'].forEach(function (id) { $(id).disabled = !live; });
    if (!live && ui.data && !$('control-msg').dataset.status) $('control-msg').textContent = 'the job is not running';
    var th = $('threshold');
    if (document.activeElement !== th && s.threshold !== null && s.threshold !== undefined) th.value = s.threshold;
  }

  function heatmapFor(s) { return s.heatmaps[ui.metric] || null; }

  function renderMetricChoice(s) {
    var sel = $('metric');
    var want = s.metrics.join(',');
    if (sel.dataset.options !== want) {
      sel.innerHTML = s.metrics.map(function (m) { return '<option value="' + esc(m) + '">' + esc(metricLabel(m)) + '</option>'; }).join('');
      sel.dataset.options = want;
    }
    sel.value = ui.metric;
  }

  function renderHeatmap(s) {
    var hm = heatmapFor(s);
    var el = $('heatmap');
    if (!hm) return;
    var rows = hm.ranks.slice(0, ui.k);
    var note = rows.length ? 'worst ' + rows.length + ' of ' + hm.total_ranks + ' ranks by their lowest ' + metricLabel(ui.metric) +
      ' score; ' + hm.t.length + ' columns' + (hm.merged > 1 ? ' (each the worst of ' + hm.merged + ' reports)' : ' (one per report)') +
      '; blank: not scored (detection off, or the rank was restarting)' : 'no straggler report has scored a rank yet';
    $('heatmap-note').textContent = note;
    el.dataset.ranks = rows.join(',');  // what the canvas shows, for tests and scripts
    el.dataset.worst = rows.length ? String(rows[0]) : '';
    var height = Math.max(140, 36 + rows.length * 22 + 50);
    if (el.style.height !== height + 'px') { el.style.height = height + 'px'; if (charts.heatmap) charts.heatmap.resize(); }
    var cells = [];
    rows.forEach(function (_, j) {
      var vals = hm.values[j];
      for (var i = 0; i < vals.length; i++) if (vals[i] !== null) cells.push([i, j, vals[i]]);
    });
    var thr = s.threshold || 0.75;
    chart('heatmap').setOption({
      animation: false,
      grid: {left: 70, right: 20, top: 8, bottom: 58},
      tooltip: {formatter: function (p) {
        return 'rank ' + rows[p.value[1]] + ' · ' + at(hm.t[p.value[0]]) + '<br>' + esc(metricLabel(ui.metric)) + ': <b>' + num(p.value[2], 3) + '</b>' +
          (p.value[2] < thr ? ' (below ' + thr + ')' : '');
      }},
      xAxis: {type: 'category', data: hm.t.map(function (t) { return Math.round(t) + ' s'; }), splitArea: {show: false},
        axisLabel: {color: '#6b7280', hideOverlap: true}, axisTick: {show: false}},
      yAxis: {type: 'category', inverse: true, data: rows.map(function (r) { return 'rank ' + r; }),
        axisLabel: {color: '#374151'}, axisTick: {show: false}},
      visualMap: {type: 'continuous', min: 0.25, max: 1, calculable: false, orient: 'horizontal', left: 70, bottom: 2,
        itemHeight: 160, itemWidth: 10, text: ['1 (fast)', 'slow'], textStyle: {color: '#6b7280', fontSize: 11},
        inRange: {color: HEAT_COLORS}},
      series: [{type: 'heatmap', data: cells, progressive: 0, itemStyle: {borderColor: '#fff', borderWidth: 1},
        emphasis: {itemStyle: {borderColor: '#111', borderWidth: 1}}}]
    }, true);
  }

  function renderDistribution(s) {
    var dist = s.distribution[ui.metric];
    if (!dist) return;
    var line = function (name, key, color, width) {
      return {name: name, type: 'line', showSymbol: false, data: dist.t.map(function (t, i) { return [t, dist[key][i]]; }),
        lineStyle: {color: color, width: width}, itemStyle: {color: color}, connectNulls: false};
    };
    var off = [], start = null;
    dist.enabled.forEach(function (e, i) {
      if (!e && start === null) start = dist.t[i];
      if (e && start !== null) { off.push([{xAxis: start}, {xAxis: dist.t[i]}]); start = null; }
    });
    if (start !== null) off.push([{xAxis: start}, {xAxis: dist.t[dist.t.length - 1]}]);
    var series = [line('min', 'min', '#c62828', 2), line('10th percentile', 'p10', '#ef8a62', 1.5), line('median', 'median', '#2f6fdb', 1.5)];
    series[0].markLine = {silent: true, symbol: 'none', lineStyle: {type: 'dashed', color: '#9ca3af'},
      label: {formatter: 'threshold', position: 'insideEndTop', color: '#6b7280', fontSize: 11}, data: s.threshold ? [{yAxis: s.threshold}] : []};
    series[0].markArea = {silent: true, itemStyle: {color: 'rgba(148,163,184,0.18)'}, label: {show: true, formatter: 'detection off', position: 'insideBottom', color: '#6b7280', fontSize: 11}, data: off};
    chart('distribution').setOption({
      animation: false, grid: {left: 40, right: 14, top: 26, bottom: 26},
      legend: {top: 0, right: 0, textStyle: {fontSize: 11, color: '#4b5563'}, itemWidth: 14},
      tooltip: {trigger: 'axis', valueFormatter: function (v) { return num(v, 3); }},
      xAxis: {type: 'value', axisLabel: {formatter: '{value} s', color: '#6b7280'}, splitLine: {show: false}},
      yAxis: {type: 'value', min: 0, max: 1, splitNumber: 4, axisLabel: {color: '#6b7280'}},
      series: series
    }, true);
  }

  function renderFlagged(s) {
    var body = $('flagged').tBodies[0];
    $('flagged-count').textContent = s.flagged_total ? '(' + s.flagged_total + (s.flagged_total > s.flagged.length ? ', slowest ' + s.flagged.length + ' shown' : '') + ')' : '';
    if (!s.flagged.length) { body.innerHTML = '<tr><td colspan="6" class="empty">no rank flagged</td></tr>'; return; }
    var then = function (a, b) { return num(a, 2) + ' <span class="dim">→</span> ' + num(b, 2); };
    body.innerHTML = s.flagged.map(function (f) {
      return '<tr data-rank="' + f.rank + '" data-slow="' + f.slow_now + '"><td><b>' + f.rank + '</b></td><td>' + at(f.t) +
        (f.interval ? ' <span class="dim">report #' + f.interval + '</span>' : '') + '</td><td>' + esc(f.action || '–') +
        '</td><td class="num" title="when flagged → in the newest report">' + then(f.relative, f.now_relative) +
        '</td><td class="num" title="when flagged → in the newest report">' + then(f.individual, f.now_individual) + '</td><td>' +
        (f.slow_now ? '<span class="tag bad">slow</span>' : '<span class="tag ok">caught up</span>') +
        (f.times > 1 ? ' <span class="dim">flagged ×' + f.times + '</span>' : '') + '</td></tr>';
    }).join('');
  }

  // -------------------------------------------------------------- step rate
  function renderRate(d) {
    var r = d.steps.rate;
    var marks = d.incidents.filter(function (i) { return i.reported; }).map(function (i) {
      return {xAxis: i.t, label: {formatter: '#' + i.index}};
    });
    (d.steps.widths || []).forEach(function (w) {  // an elastic job's width: processes computing its logical ranks
      marks.push({xAxis: w.t, lineStyle: {color: '#2a9d8f', type: 'solid'},
                  label: {color: '#2a9d8f', formatter: w.processes + '/' + w.logical + ' (' + w.cause + ')'}});
    });
    var areas = d.incidents.filter(function (i) { return i.reported && i.total_s > 0; }).map(function (i) {
      return [{xAxis: i.t}, {xAxis: i.t + i.total_s}];
    });
    chart('rate').setOption({
      animation: false, grid: {left: 44, right: 18, top: 22, bottom: 26},
      tooltip: {trigger: 'axis', valueFormatter: function (v) { return num(v, 1) + ' steps/s'; }},
      xAxis: {type: 'value', min: 0, axisLabel: {formatter: '{value} s', color: '#6b7280'}, splitLine: {show: false}},
      yAxis: {type: 'value', min: 0, axisLabel: {color: '#6b7280'}, splitNumber: 4},
      series: [{name: 'steps/s', type: 'line', step: 'middle', showSymbol: false, data: r.t.map(function (t, i) { return [t, r.v[i]]; }),
        lineStyle: {color: '#2f6fdb', width: 1.5}, areaStyle: {color: 'rgba(47,111,219,0.12)'},
        markLine: {silent: true, symbol: 'none', lineStyle: {color: '#d1495b', type: 'dashed'}, label: {color: '#d1495b', position: 'end'}, data: marks},
        markArea: {silent: true, itemStyle: {color: 'rgba(209,73,91,0.10)'}, data: areas}}]
    }, true);
  }

  // --------------------------------------------------------------- recovery
  function faultLabel(i) {
    var kind = i.kind || 'fault';
    return '#' + i.index + ' ' + kind + (i.ranks.length ? ' r' + i.ranks.join(',') : '');
  }

  function renderTimeline(d) {
    var inc = d.incidents.filter(function (i) { return i.segments.length; });
    var el = $('timeline');
    el.hidden = !inc.length;
    if (!inc.length) return;
    var height = 60 + inc.length * 30;
    if (el.style.height !== height + 'px') { el.style.height = height + 'px'; if (charts.timeline) charts.timeline.resize(); }
    var maxTotal = Math.max.apply(null, inc.map(function (i) { return i.total_s; }).concat([1e-6]));
    var series = SEG_ORDER.map(function (name) {
      return {name: SEGMENTS[name].label, type: 'bar', stack: 'total', barMaxWidth: 20,
        itemStyle: {color: SEGMENTS[name].color},
        label: {show: true, color: '#fff', fontSize: 11, formatter: function (p) { return p.value > maxTotal * 0.09 ? secs(p.value) : ''; }},
        data: inc.map(function (i) {
          var seg = i.segments.filter(function (s) { return s[0] === name; })[0];
          return seg ? seg[1] : 0;
        })};
    });
    chart('timeline').setOption({
      animation: false, grid: {left: 120, right: 24, top: 28, bottom: 26},
      legend: {top: 0, left: 120, itemWidth: 12, itemHeight: 10, textStyle: {fontSize: 11, color: '#4b5563'},
        data: SEG_ORDER.map(function (n) { return SEGMENTS[n].label; })},
      tooltip: {trigger: 'axis', axisPointer: {type: 'shadow'}, formatter: function (ps) {
        var i = inc[ps[0].dataIndex];
        return '<b>' + esc(faultLabel(i)) + '</b> ' + esc(i.phase || '') + (i.step !== null && i.step !== undefined ? ' step ' + i.step : '') + '<br>' +
          ps.filter(function (p) { return p.value > 0; }).map(function (p) { return p.marker + p.seriesName + ': ' + secs(p.value); }).join('<br>') +
          '<br>total ' + secs(i.total_s);
      }},
      xAxis: {type: 'value', min: 0, axisLabel: {formatter: function (v) { return secs(v); }, color: '#6b7280'}},
      yAxis: {type: 'category', inverse: true, data: inc.map(faultLabel), axisLabel: {color: '#374151'}, axisTick: {show: false}},
      series: series
    }, true);
  }

  function segCell(i, name) {
    var seg = i.segments.filter(function (s) { return s[0] === name; })[0];
    return '<td class="num" data-seg="' + name + '">' + (seg ? '<span class="seg" style="background:' + SEGMENTS[name].color + '"></span>' + secs(seg[1]) : '–') + '</td>';
  }

  function stateTag(st) {
    var cls = /^recovered/.test(st) ? 'ok' : /not/.test(st) ? 'bad' : /tolerated|flagged/.test(st) ? 'wrap' : 'warn';
    return '<span class="tag ' + cls + '">' + esc(st) + '</span>';
  }

  function renderIncidents(d) {
    var body = $('incidents').tBodies[0];
    body.querySelectorAll('details[data-index]').forEach(function (el) { ui.openDetails[el.dataset.index] = el.open; });
    if (!d.incidents.length) { body.innerHTML = '<tr><td colspan="14" class="empty">no fault so far</td></tr>'; return; }
    body.innerHTML = d.incidents.map(function (i) {
      var inj = i.injected.length ? i.injected.map(function (x) {
        return x.kind + (i.injected.length > 1 ? ' r' + x.rank + (x.phase ? ' ' + x.phase : '') : '');
      }).join(' + ') + ' (injected)' : 'fault';
      var fault = esc(inj) + (i.phase ? ' · ' + esc(i.phase) : '') + (i.step !== null && i.step !== undefined ? ' · step ' + i.step : '');
      var first = i.segments.filter(function (s) { return s[0] === 'first_step' || s[0] === 'recovering'; })[0];
      var planted = i.injected.map(function (x) { return x.kind + '@' + x.rank; }).join(' ');
      var row = '<tr class="incident" data-index="' + i.index + '" data-kind="' + esc(i.kind || '') + '" data-faults="' + esc(planted) + '" data-ranks="' + i.ranks.join(',') +
        '" data-phase="' + esc(i.phase || '') + '" data-state="' + esc(i.state) + '"><td>' + i.index + '</td><td class="nowrap">' + at(i.t) + '</td><td>' + fault +
        '</td><td>' + (i.ranks.length ? i.ranks.join(', ') : '–') + '</td><td>' + esc(i.cause || '–') + '</td><td>' + stateTag(i.state) + '</td>' +
        ['detect', 'abort', 'rendezvous', 'heal', 'other'].map(function (n) { return segCell(i, n); }).join('') +
        (first ? segCell(i, first[0]).replace('data-seg="recovering"', 'data-seg="first_step"') : '<td class="num" data-seg="first_step">–</td>') +
        '<td class="num"><b>' + (i.segments.length ? secs(i.total_s) : '–') + '</b></td><td class="num">' +
        (i.steps_redone === null || i.steps_redone === undefined ? '–' : i.steps_redone) + '</td></tr>';
      var more = [];
      if (i.hang) more.push('<div><b>hang</b> no progress in <i>' + esc(i.hang.section) + '</i> (step ' + esc(i.hang.step) + ') for ' +
        secs(i.hang.since_progress_s) + ', timeout ' + secs(i.hang.timeout_s) + (i.stuck_in ? '; stuck in <span class="mono">' + esc(i.stuck_in) + '</span>' : '') + '</div>');
      if (i.spawned && i.spawned.length) more.push('<div><b>replacement</b> ' + i.spawned.map(function (s) {
        return 'rank ' + s.rank + ': ' + (s.warm ? 'warm spare' + (s.spare_ready ? '' : ' (still warming up)') : 'cold start') +
          (s.started_s !== null && s.started_s !== undefined ? ', ran the script ' + secs(s.started_s) + ' after spawn' : '');
      }).join('; ') + '</div>');
      if (i.reporters && i.reporters.length) more.push('<div><b>survivors</b> ' + i.reporters.map(function (r) {
        return (r.rank === i.critical_rank ? '<b>rank ' + r.rank + ' (slowest)</b>' : 'rank ' + r.rank) + ': abort ' + secs(r.abort_s) +
          ', rendezvous ' + secs(r.rendezvous_s) + ', heal ' + secs(r.heal_s);
      }).join('; ') + (i.resume_step !== undefined && i.resume_step !== null ? '; resumed at step ' + i.resume_step : '') + '</div>');
      if (i.from_disk_step !== undefined) more.push('<div><b>resumed from disk</b> at step ' + esc(i.from_disk_step) + '</div>');
      if (i.error) more.push('<details data-index="e' + i.index + '"' + (ui.openDetails['e' + i.index] ? ' open' : '') + '><summary>' +
        (i.error_from_culprit ? 'error' : 'what the survivors saw') + '</summary><div class="mono small">' + esc(i.error) + '</div></details>');
      if (i.stacks) more.push('<details data-index="' + i.index + '"' + (ui.openDetails[i.index] ? ' open' : '') +
        '><summary>Python stacks of hung rank ' + i.ranks.join(', ') + '</summary><pre class="stacks">' + esc(i.stacks) + '</pre></details>');
      return row + (more.length ? '<tr class="details" data-index="' + i.index + '"><td></td><td colspan="13">' + more.join('') + '</td></tr>' : '');
    }).join('');
  }

  // ------------------------------------------------------------ checkpoints
  function renderCheckpoints(d) {
    var c = d.checkpoints;
    var chips = [
      ['saves', c.total], ['committed', c.committed], ['failed', c.failed_total, c.failed_total > 0],
      ['skipped (previous in flight)', c.skipped], ['verify failures', c.invalid.length, c.invalid.length > 0],
      ['max stall', secs(c.stall_max_s)], ['mean durable', secs(c.durable_mean_s)], ['max durable', secs(c.durable_max_s)]
    ];
    $('ckpt-summary').innerHTML = chips.map(function (k) {
      return '<span class="chip' + (k[2] ? ' bad' : '') + '">' + esc(k[0]) + ' <b>' + esc(k[1]) + '</b></span>';
    }).join('');
    var el = $('ckpt-chart');
    el.hidden = !c.saves.length;
    if (c.saves.length) {
      var steps = c.saves.map(function (s) { return s.step; });
      var yAxis = function (i, name) {
        return {gridIndex: i, type: 'value', name: name, nameTextStyle: {color: '#4b5563', align: 'left'}, splitNumber: 2,
          axisLabel: {formatter: function (v) { return secs(v); }, color: '#6b7280'}};
      };
      chart('ckpt-chart').setOption({
        animation: false,
        grid: [{left: 64, right: 16, top: 22, height: '28%'}, {left: 64, right: 16, top: '58%', bottom: 34}],
        tooltip: {trigger: 'axis', formatter: function (ps) {
          var sv = c.saves[ps[0].dataIndex];
          return '<b>step ' + sv.step + '</b> ' + at(sv.t) + '<br>stall ' + secs(sv.stall_s) + '<br>durable ' +
            (sv.failed ? '<b style="color:#c62828">failed</b>' : secs(sv.durable_s)) + '<br>' + (sv.bytes / 1e6).toFixed(2) + ' MB staged';
        }},
        axisPointer: {link: [{xAxisIndex: 'all'}]},
        xAxis: [{gridIndex: 0, type: 'category', data: steps, axisLabel: {show: false}, axisTick: {show: false}},
          {gridIndex: 1, type: 'category', data: steps, name: 'step', nameLocation: 'middle', nameGap: 22, axisLabel: {color: '#6b7280'}}],
        yAxis: [yAxis(0, 'stall (training blocked)'), yAxis(1, 'durable (save to committed)')],
        series: [
          {name: 'stall', type: 'bar', xAxisIndex: 0, yAxisIndex: 0, barMaxWidth: 16, itemStyle: {color: '#edae49'},
            data: c.saves.map(function (s) { return s.stall_s; })},
          {name: 'durable', type: 'bar', xAxisIndex: 1, yAxisIndex: 1, barMaxWidth: 16, itemStyle: {color: '#00798c'},
            data: c.saves.map(function (s) { return s.failed ? null : s.durable_s; })},
          {name: 'failed', type: 'scatter', xAxisIndex: 1, yAxisIndex: 1, symbol: 'triangle', symbolSize: 10, itemStyle: {color: '#c62828'},
            data: c.saves.map(function (s) { return s.failed ? 0 : null; })}
        ]
      }, true);
    }
    var rows = [];
    c.failed.forEach(function (f) { rows.push('<tr><td><span class="tag bad">failed</span></td><td>step ' + esc(f.step) + '</td><td>rank ' + esc(f.rank) + '</td><td>' + at(f.t) + '</td><td class="mono">' + esc(f.reason) + '</td></tr>'); });
    c.invalid.forEach(function (f) { rows.push('<tr><td><span class="tag bad">did not verify</span></td><td>step ' + esc(f.step) + '</td><td>rank ' + esc(f.rank) + '</td><td>' + at(f.t) + '</td><td class="mono">' + esc(f.file) + ': ' + esc(f.reason) + '</td></tr>'); });
    c.loaded.forEach(function (f) { rows.push('<tr><td><span class="tag">loaded</span></td><td>step ' + esc(f.step) + '</td><td>rank ' + esc(f.rank) + '</td><td>' + at(f.t) + '</td><td></td></tr>'); });
    $('ckpt-problems').tBodies[0].innerHTML = rows.join('') || (c.total ? '' : '<tr><td class="empty">no checkpoint saved (the job has no disk checkpoints, or none is due yet)</td></tr>');
  }

  // ----------------------------------------------------------------- render
  function render(d) {
    ui.data = d;
    renderHeader(d);
    renderMetricChoice(d.straggler);
    renderDetection(d.straggler);
    renderHeatmap(d.straggler);
    renderDistribution(d.straggler);
    renderFlagged(d.straggler);
    renderRate(d);
    renderTimeline(d);
    renderIncidents(d);
    renderCheckpoints(d);
    document.body.dataset.version = String(d.version);
    document.body.dataset.ready = '1';
  }

  // ------------------------------------------------------------------- live
  var RETRY_MS = 2000;

  function setLive(text, on) { $('live').textContent = text; $('live').className = 'live ' + (on ? 'on' : 'off'); }

  function connect() {
    if (ui.source) ui.source.abort();
    clearTimeout(ui.retry);
    if (!token()) { setLive('needs the token printed on the console (paste it below)', false); return; }
    var ctl = new AbortController();
    ui.source = ctl;
    fetch('api/stream?metric=' + encodeURIComponent(ui.metric),
          {headers: {'X-Dashboard-Token': token()}, signal: ctl.signal, cache: 'no-store'}).then(function (r) {
      if (r.status === 403) { setLive('refused: wrong token (paste the one printed on the console)', false); return; }
      if (!r.ok || !r.body) throw new Error('HTTP ' + r.status);
      setLive('live', true);
      sessionStorage.setItem('rt-dashboard-token', token());
      var reader = r.body.getReader(), decoder = new TextDecoder(), buf = '';
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) throw new Error('stream ended');
          buf += decoder.decode(chunk.value, {stream: true}).replace(/\r\n?/g, '\n');
          var end;
          while ((end = buf.indexOf('\n\n')) >= 0) {  // one server-sent event per blank-line-terminated block
            var block = buf.slice(0, end), data = [], kind = 'message';
            buf = buf.slice(end + 2);
            block.split('\n').forEach(function (line) {
              if (line.indexOf('data:') === 0) data.push(line.slice(5).replace(/^ /, ''));
              else if (line.indexOf('event:') === 0) kind = line.slice(6).trim();
            });
            if (kind === 'state' && data.length) render(JSON.parse(data.join('\n')));
          }
          return pump();
        });
      }
      return pump();
    }).catch(function () {
      if (ctl.signal.aborted) return;  // a new connection replaced this one
      if (ui.data && ui.data.run.state !== 'running') {  // the job ended and its agent took the server down
        setLive('job ended; server stopped', false);
        return;
      }
      setLive('disconnected, retrying', false);
      ui.retry = setTimeout(connect, RETRY_MS);
    });
  }

  function token() { return $('token').value.trim(); }

  function exportPage(ev) {  // a download needs the token too: fetched, then saved from memory
    ev.preventDefault();
    fetch('api/export', {headers: {'X-Dashboard-Token': token()}, cache: 'no-store'}).then(function (r) {
      if (!r.ok) throw new Error(r.status === 403 ? 'refused: wrong token' : 'HTTP ' + r.status);
      var name = /filename="([^"]+)"/.exec(r.headers.get('Content-Disposition') || '');
      return r.blob().then(function (b) { return {blob: b, name: name ? name[1] : 'dashboard.html'}; });
    }).then(function (f) {
      var a = document.createElement('a');
      a.href = URL.createObjectURL(f.blob);
      a.download = f.name;
      document.body.appendChild(a);
      a.click();
      setTimeout(function () { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
    }).catch(function (e) { setLive('export failed: ' + e.message, false); });
  }

  function control(body) {
    var msg = $('control-msg');
    if (!token()) { msg.textContent = 'paste the token the dashboard printed on the console'; return; }
    msg.textContent = 'sending…';
    fetch('api/straggler', {method: 'POST', headers: {'Content-Type': 'application/json', 'X-Dashboard-Token': token()},
      body: JSON.stringify(body)}).then(function (r) {
      return r.json().then(function (j) { return {status: r.status, body: j}; });
    }).then(function (r) {
      if (r.status === 200) {
        sessionStorage.setItem('rt-dashboard-token', token());
        msg.textContent = 'requested; takes effect at the next report';
        delete msg.dataset.applied;
        ui.requestedAt = r.body.at;
      } else {
        msg.textContent = (r.status === 403 ? 'refused: wrong token' : 'refused: ' + (r.body.error || r.status));
      }
      msg.dataset.status = String(r.status);
    }).catch(function (e) { msg.textContent = 'failed: ' + e; });
  }

  function setup() {
    $('metric').addEventListener('change', function () {
      ui.metric = this.value;
      if (LIVE) connect();
      if (ui.data && ui.data.straggler.heatmaps[ui.metric]) render(ui.data);
    });
    $('k').addEventListener('change', function () { ui.k = Number(this.value); if (ui.data) render(ui.data); });
    if (!LIVE) {
      $('control-form').hidden = true;
      render(JSON.parse(embedded.textContent));
      return;
    }
    $('export-link').hidden = false;
    $('export-link').addEventListener('click', exportPage);
    $('token').addEventListener('change', function () { $('control-msg').textContent = ''; connect(); });
    var m = /(?:^|[#&])token=([^&]+)/.exec(location.hash);
    var saved = m ? decodeURIComponent(m[1]) : sessionStorage.getItem('rt-dashboard-token');
    if (saved) {
      $('token').value = saved;
      sessionStorage.setItem('rt-dashboard-token', saved);
      $('token-label').hidden = true;
    }
    if (m) history.replaceState(null, '', location.pathname + location.search);  // keep the token out of the address bar
    $('toggle-detection').addEventListener('click', function () { control({enabled: this.dataset.next === 'on'}); });
    $('apply-threshold').addEventListener('click', function () {
      var v = Number($('threshold').value);
      if (!(v > 0 && v <= 1)) { $('control-msg').textContent = 'the threshold must be in (0, 1]'; return; }
      control({threshold: v});
    });
    connect();
  }

  setup();
})();
