"""Views: what a caller reads of a job, rendered in one place.

==========  =======================================================================================================
module      owns
==========  =======================================================================================================
``render``  job views as JSON bytes (``encode``, ``EncodedView``, ``stream``), the selections (``Selection``:
            ``calls=``, ``fields=``), call summaries, the cache of ended jobs' views (``ViewCache``)
``read``    reading jobs (``JobViews``): the view of a live or stored job, output offsets and ranges, pages of
            ``GET /jobs``, ``wait``, the event stream
``resume``  the event stream's position (``Position``): each event's opaque ``id``, where a ``Last-Event-ID``
            resumes
==========  =======================================================================================================

``render`` sits below the job service (the runner encodes the final view); ``read`` above it. The HTTP answers
made of views (streamed bodies, ranges) are ``service.api.responses``.
"""
