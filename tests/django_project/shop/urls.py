from django.urls import path

from tests.django_project.orders import views

urlpatterns = [path("orders", views.create_order)]
